"""Reward functions the dist tests name by `module:attribute`."""

from __future__ import annotations

from llmtrain.rewards.reversal import reversal_score, target_of


def even_targets_only(prompts: list[str], responses: list[str], **_) -> list[float]:
    """The reversal score where the target has an even length, 0 where it is odd: a group of an odd-length prompt
    always agrees (ppo.filter_groups drops it), an even one varies as soon as two samples differ."""
    return [reversal_score(r, target_of(p)) if len(target_of(p)) % 2 == 0 else 0.0 for p, r in zip(prompts, responses)]
