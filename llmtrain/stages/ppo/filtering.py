"""DAPO's dynamic sampling (`ppo.filter_groups`): keep the groups whose scores differ, refill from the next prompts.

A group whose n samples all score the same has zero group-relative advantage: it trains nothing but the KL term
and shrinks the batch's effective size. Each round generates from one more batch of prompts (every dp rank its
share), gathers the rollouts and their scores on every rank, and stops once the rounds so far hold
`ppo.rollout.prompts_per_step` varied groups or after `ppo.filter_max_rounds` rounds. The step then trains on the
first prompts_per_step varied groups (in round, rank, prompt order); when the rounds found fewer, the earliest
uniform groups top the batch up (counted: `filter_topped_up`), so every step keeps its size, its mini-batches and the
lr schedule's count. The kept rows form the global experience every rank holds, so the update's seeded layout
gives each rank the same number of sequences whichever rank generated them.
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.nn.functional as F

from llmtrain.stages.ppo.experience import Experience


def varied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """scores (N,), N = G·n, a group's n samples consecutive -> (G,) bool: its scores are not all equal. NaN (an
    unscored row, advantage 0) is left out: only two scored rows that differ make a group varied."""
    grouped = scores.view(-1, group_size)  # (G, n)
    unscored = grouped.isnan()
    highest = grouped.masked_fill(unscored, -torch.inf).amax(-1)
    return highest > grouped.masked_fill(unscored, torch.inf).amin(-1)


def chosen_groups(varied: torch.Tensor, target: int) -> tuple[torch.Tensor, int]:
    """varied (G,) bool -> (indices of the `target` groups kept, in their order; how many of them are uniform)."""
    order = torch.arange(varied.numel(), device=varied.device)
    kept = order[varied][:target]
    topped_up = target - kept.numel()
    if topped_up > 0:
        kept = torch.cat([kept, order[~varied][:topped_up]]).sort().values
    return kept, max(topped_up, 0)


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """(k,) group indices -> (k·n,) row indices."""
    return (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).flatten()


def concat_experiences(parts: list[Experience], pad_token_id: int) -> Experience:
    """Rounds of different widths as one batch: prompts left-padded and responses right-padded to the widest
    (the padding is masked out, and each micro-batch is trimmed of it again before a forward)."""
    if len(parts) == 1:
        return parts[0]
    prompt = max(p.sequences.shape[1] - p.num_actions for p in parts)
    actions = max(p.num_actions for p in parts)
    return Experience(**{f.name: torch.cat([_widened(p, f.name, prompt, actions, pad_token_id) for p in parts])
                         for f in fields(Experience)})


FULL_WIDTH = ("sequences", "attention_mask")  # (B, P + A); every other 2-D field is (B, A)


def _widened(part: Experience, name: str, prompt: int, actions: int, pad_token_id: int) -> torch.Tensor:
    tensor = getattr(part, name)
    if tensor.dim() == 1:
        return tensor
    right = actions - part.num_actions
    if name not in FULL_WIDTH:
        return F.pad(tensor, (0, right))  # zeros / False past the response
    left = prompt - (part.sequences.shape[1] - part.num_actions)
    return F.pad(tensor, (left, right), value=pad_token_id if name == "sequences" else 0)
