"""JSON over HTTP to an inference server, with errors that name the server and what was asked (no extra dependency:
the standard library's urllib)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class EngineError(RuntimeError):
    """An inference engine did not do what a rollout or a weight sync needs; the message names its URL."""


def call(url: str, path: str, payload: dict | None = None, *, method: str | None = None,
         timeout_s: float = 60.0) -> dict:
    """`method` (POST when there is a payload, else GET) url + path -> the JSON answer (an empty answer: {})."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            body = answer.read()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:500]
        raise EngineError(f"inference engine {url}: {path} answered HTTP {error.code}: {detail}") from error
    except (urllib.error.URLError, OSError) as error:  # refused, unreachable, timed out, reset
        reason = getattr(error, "reason", error)
        raise EngineError(f"inference engine {url}: {path} failed ({reason}); is the server running and reachable "
                          "from this machine? (ppo.rollout.vllm.urls)") from error
    return json.loads(body) if body.strip() else {}


def reachable(url: str, timeout_s: float = 2.0) -> bool:
    try:
        call(url, "/health", timeout_s=timeout_s)
        return True
    except EngineError:
        return False
