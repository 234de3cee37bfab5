"""Rollout engines (`ppo.rollout.engine`), one protocol: `start(actor)`, `sync(actor, version) -> metrics` (the
policy's weights into the engine, verified), `generate(actor, prompts, sampling, ...) -> Rollout` (token ids and
the sampled log-probs), `turns(...)` (multi-turn rollouts: a context giving a TurnDraw, below), `after_rollout()`,
`close()`.

- hf: the training model's own forward (stages/ppo/rollout.py), always on the current weights.
- vllm: vLLM servers in their own environment (engines/vllm.py), weights pushed before each rollout that needs them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch

from llmtrain.stages.ppo import rollout

# One turn of a multi-turn rollout (stages/ppo/tools/multiturn.py): (token lists: each active trajectory's prompt and
# completion so far, each one's token budget, each one's index in the rollout, the turn's number) -> per list, the
# tokens drawn after it (through its first stop token, at most its budget) and each one's sampled log-prob.
TurnDraw = Callable[[list[list[int]], list[int], list[int], int], list[tuple[list[int], list[float]]]]


class HFEngine:
    """The actor samples its own rollouts: nothing to start, nothing to sync."""

    def start(self, actor) -> None:
        del actor

    def sync(self, actor, version: str) -> dict:
        del actor, version
        return {}

    def generate(self, actor, batch, settings, **options) -> rollout.Rollout:
        return rollout.generate(actor, batch, settings, **options)

    @contextlib.contextmanager
    def turns(self, actor, settings, *, pad_token_id: int, eos_ids: list[int], seed: int, device):
        """(a TurnDraw on the actor, the seconds its gather took): one sampling context (rollout.sampling_model) for
        every turn of the rollout, its RNG seeded once from `seed`."""
        with rollout.sampling_model(actor, seed, device) as (model, gather_s):
            yield hf_turn_draw(model, settings, pad_token_id, eos_ids, device), gather_s

    def after_rollout(self) -> None:
        pass

    def close(self) -> None:
        pass


def hf_turn_draw(model, settings, pad_token_id: int, eos_ids: list[int], device) -> TurnDraw:
    """The lean sampler (rollout.drawer) on left-padded token lists, settings.batch_size lists per call."""
    stop = torch.tensor(eos_ids)

    def draw(rows: list[list[int]], budgets: list[int], indices: list[int], turn: int):
        del indices, turn  # one RNG stream for the whole rollout
        sample = rollout.drawer(model, replace(settings, max_new_tokens=max(budgets)), pad_token_id, eos_ids)
        size, drawn_rows = settings.batch_size or len(rows), []
        for lo in range(0, len(rows), size):
            ids, mask = left_padded(rows[lo:lo + size], pad_token_id, device)
            out, logps = sample(ids, mask)  # (b, W + a), (b, a)
            drawn = out[:, ids.shape[1]:].cpu()
            keep = rollout.up_to_first_eos(drawn, stop)  # (b, a): through the first stop token
            for row, row_keep, row_logps, budget in zip(drawn, keep, logps.float().cpu(), budgets[lo:]):
                tokens = row[row_keep][:budget].tolist()
                drawn_rows.append((tokens, row_logps[:len(tokens)].tolist()))
        return drawn_rows

    return draw


def left_padded(rows: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (b, W) ids left-padded with pad, (b, W) mask."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


ROLLOUT_ENGINES = ("hf", "vllm")
