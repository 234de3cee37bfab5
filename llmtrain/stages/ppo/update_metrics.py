"""Metrics of PPO's update: the train-inference mismatch of its first mini-batch (on the one-update shortcut, or with
the engine's old log-probs, where the experience makes no actor forward) over every rank, and per-update shares."""

from __future__ import annotations

import torch

from llmtrain.distributed import all_reduce_max, all_reduce_sum

KEYS = ("mismatch_logp_abs_mean", "mismatch_kl", "mismatch_frac_outside_clip")


def update_mismatch(parts: list[tuple[dict, int]], device) -> dict:
    """(metrics, action tokens) of each micro-batch -> the metrics weighted by their action tokens, over every rank
    (the max over every rank for mismatch_logp_abs_max)."""
    sums = torch.tensor([[m[k] * n for k in KEYS] + [n] for m, n in parts] or [[0.0] * 4], dtype=torch.float64,
                        device=device).sum(0)
    sums = all_reduce_sum(sums, None)
    worst = all_reduce_max(torch.tensor([max([m["mismatch_logp_abs_max"] for m, _ in parts] + [0.0])],
                                        dtype=torch.float64, device=device), None).item()
    count = max(sums[-1].item(), 1.0)
    return {"mismatch_logp_abs_max": worst, **{k: (v / count).item() for k, v in zip(KEYS, sums[:-1])}}


def add_share(sums: dict, metrics: dict, prefix: str, updates: int) -> None:
    """Average per-update metrics (an MoE role's router aux loss) over the iteration's `updates`, keys prefixed."""
    for name, value in metrics.items():
        sums[prefix + name] = sums.get(prefix + name, 0.0) + value / updates
