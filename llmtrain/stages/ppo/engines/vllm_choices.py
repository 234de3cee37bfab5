"""A vLLM server's answer to `/inference/v1/generate`, read: each choice's tokens and sampled log-probs, the weight
versions that sampled them, and what a checkpoint keeps of it (engines/vllm.py)."""

from __future__ import annotations

import torch

from llmtrain.stages.ppo.engines.http import EngineError


def slim(choice: dict) -> dict:
    """What a checkpoint keeps of a server's choice: what collect lays out and checks."""
    content = (choice.get("logprobs") or {}).get("content", [])
    return {"index": choice.get("index"), "token_ids": choice["token_ids"],
            "logprobs": {"content": [{"logprob": entry["logprob"]} for entry in content]},
            "finish_reason": choice.get("finish_reason"), "stop_reason": choice.get("stop_reason"),
            "weight_versions": choice.get("weight_versions")}


def check_versions(url: str, choices: list[dict], expected: str | None) -> None:
    seen = {part["version"] for choice in choices for part in choice.get("weight_versions") or []}
    if seen != {expected}:
        raise EngineError(f"inference engine {url} sampled with weight versions {sorted(seen)}, expected only "
                          f"{expected!r} (the version the requests were sent under): a rollout on other weights")


def tokens_and_logps(choice: dict) -> tuple[list[int], torch.Tensor]:
    """A choice's tokens and each one's sampled log-prob; the stop token it ended at appended when the engine left
    it out (the action mask keeps the stop token: the reward model scores there)."""
    tokens = list(choice["token_ids"])
    values = [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content", [])]
    stop = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(stop, int) and (not tokens or tokens[-1] != stop):
        tokens.append(stop)
        values.append(0.0)  # not reported: the mismatch metrics then see its full trainer log-prob
    return tokens, torch.tensor(values[:len(tokens)], dtype=torch.float32)
