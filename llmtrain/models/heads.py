"""Scalar heads: one score per token from a sequence-classification model, pooled where the stage says.

transformers' `*ForSequenceClassification` pools at the rightmost token that is not the pad id; with
pad == eos (the usual setup for tokenizers without a pad token) that is the token BEFORE the EOS. So
llmtrain reads the per-token scores of the `score` layer during the model's own forward (a forward hook:
it works under every wrapper, DDP, DeepSpeed, FSDP2, because the wrapper's forward still runs) and pools
them itself, at each row's last real token, found from the lengths / attention mask.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

SCORE_LAYERS = ("score", "v_head", "classifier")


def score_layer(model: torch.nn.Module) -> torch.nn.Module:
    for name in SCORE_LAYERS:
        layer = getattr(model, name, None)
        if isinstance(layer, torch.nn.Module):
            return layer
    raise ValueError(f"{type(model).__name__} has no scalar head ({' / '.join(SCORE_LAYERS)})")


@contextlib.contextmanager
def captured_token_scores(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, every forward of `model` appends its per-token scores (B, T) to the yielded list."""
    captured: list[torch.Tensor] = []

    def keep(module, inputs, output) -> None:
        captured.append(output[..., 0])  # (B, T, 1) -> (B, T)

    handle = score_layer(model).register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def sequence_scores(forward, model: torch.nn.Module, last_index: torch.Tensor, **inputs) -> torch.Tensor:
    """Run `forward(**inputs)` (the engine's module) and return the scores at `last_index` (B,): one sequence
    per row, each row's index turned into a flat position for `scores_at`."""
    batch, width = inputs["input_ids"].shape
    return scores_at(forward, model, torch.arange(batch) * width + last_index.cpu(), **inputs)


def scores_at(forward, model: torch.nn.Module, ends: torch.Tensor, **inputs) -> torch.Tensor:
    """Run `forward(**inputs)` and return the scores at the flat positions `ends` (S,) of the (B·T) tokens:
    several sequences may share a packed row. An end of -1 (a sequence shard without that sequence's last token)
    scores 0."""
    with captured_token_scores(model) as captured:
        forward(**inputs)
    scores = captured[-1].flatten()  # (B·T,)
    ends = ends.to(scores.device)
    return torch.where(ends >= 0, scores[ends.clamp(min=0)], 0.0).float()
