"""Scores from a reward server (`ppo.reward.url`; OpenRLHF's `--remote_rm_url`): each rank posts its responses in
batches of `ppo.reward.url_batch_size` as JSON and reads one number per response back.

Request (POST, `Content-Type: application/json`), OpenRLHF's fields and ours:
    {"query": [prompt + response as the model saw them (special tokens kept, padding dropped)],
     "prompts": [the raw prompt column: text or messages], "responses": [each response's text, as reward functions
     see it], "labels": [the reference answer column, or null], "columns": {the data's other columns}}
Answer: {"rewards": [one number per response]} (OpenRLHF's key; "scores" is read where "rewards" is absent).

A connection error, a timeout or an HTTP 5xx is retried `url_retries` times (backing off 0.5 s, 1 s, ...), each try
bounded by `url_timeout_s`; an HTTP 4xx, an answer of the wrong length or a non-number (null, text, infinity) stops
the run naming the URL. The failure is agreed over the data-parallel ranks (rewards.combined_scores), so no rank is
left waiting in a collective for one whose request failed.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from llmtrain.data.prompts import REFERENCE


class RewardServerError(RuntimeError):
    """The reward server did not answer one finite number per response; the message names its URL."""


class _Retryable(Exception):
    """A failed try that the next may not repeat: a 5xx answer, a refused or timed-out connection."""


@dataclass(frozen=True)
class RemoteReward:
    url: str
    batch_size: int = 64
    timeout_s: float = 60.0
    retries: int = 2

    @property
    def name(self) -> str:
        return self.url

    def score_completions(self, completions) -> list[float]:
        """One score per response of `completions` (rewards.Completions), batch by batch."""
        scores = []
        for start in range(0, len(completions.texts), self.batch_size):
            rows = slice(start, start + self.batch_size)
            body = request_body(completions, rows)
            scores += self._checked(self._post(body), len(body["responses"]))
        return scores

    def _post(self, body: dict) -> dict:
        """One request, retried on a 5xx answer or a failed connection (each try bounded by url_timeout_s, with a
        back-off between tries); the last failure, or any other, stops the run naming the URL."""
        data = json.dumps(body, default=str).encode()  # a column of dates or arrays: as text
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            try:
                return self._post_once(data)
            except _Retryable as error:
                failure = error
        raise RewardServerError(str(failure)) from failure.__cause__

    def _post_once(self, data: bytes) -> dict:
        request = urllib.request.Request(self.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            message = f"reward server {self.url} (ppo.reward.url) answered HTTP {error.code}: {detail}"
            raise (_Retryable if error.code >= 500 else RewardServerError)(message) from error
        except (urllib.error.URLError, OSError) as error:  # refused, unreachable, timed out, reset
            raise _Retryable(f"reward server {self.url} (ppo.reward.url) failed {self.retries + 1} times "
                             f"({getattr(error, 'reason', error)}), each try bounded by ppo.reward.url_timeout_s="
                             f"{self.timeout_s}: is it running and reachable from every rank?") from error
        except json.JSONDecodeError as error:
            raise RewardServerError(f"reward server {self.url} (ppo.reward.url) answered something that is not "
                                    f"JSON: {error}") from error

    def _checked(self, answer: dict, count: int) -> list[float]:
        key = "rewards" if "rewards" in answer else "scores"
        values = answer.get(key) if isinstance(answer, dict) else None
        if not isinstance(values, list):
            raise RewardServerError(f"reward server {self.url} (ppo.reward.url) answered without a \"rewards\" list: "
                                    f"{str(answer)[:200]}")
        if len(values) != count:
            raise RewardServerError(f"reward server {self.url} (ppo.reward.url) answered {len(values)} rewards for "
                                    f"{count} responses")
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise RewardServerError(f"reward server {self.url} (ppo.reward.url) answered a reward that is not a finite "
                                    f"number: {bad[0]!r}; answer one number per response")
        return [float(v) for v in values]


def request_body(completions, rows: slice) -> dict:
    columns = {k: v[rows] for k, v in completions.columns.items()}
    return {"query": completions.queries[rows], "prompts": completions.prompts[rows],
            "responses": completions.texts[rows], "labels": columns.get(REFERENCE), "columns": columns}
