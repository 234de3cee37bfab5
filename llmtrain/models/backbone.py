"""The decoder stack inside a causal LM: what transformers' base-model plans (tp, pp) name their paths in."""

from __future__ import annotations

import torch


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """`model.base_model`, except where a class's `base_model_prefix` names no attribute of it (Llama-4's text causal
    LM: prefix "language_model", stack at `.model`) and `base_model` is the whole model: then its one transformers
    model child."""
    from transformers import PreTrainedModel

    base = model.base_model
    if base is not model:
        return base
    stacks = [child for child in model.children() if isinstance(child, PreTrainedModel)]
    return stacks[0] if len(stacks) == 1 else model
