"""Experience: everything PPO's update reads about a rollout, computed once, before the update.

B sequences of width T = P + A (P prompt columns, A action columns). Log-probs of the actor (old) and
the reference come from forwards with the same temperature, position ids and no dropout as the update's
own, so the first mini-batch of an iteration has ratio exactly 1. Values: V_t from the hidden state
before action t (the critic's per-token scores `[:, -A-1:-1]`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from llmtrain.losses.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, token_rewards, whiten
from llmtrain.losses.kl import KL_ESTIMATORS
from llmtrain.losses.ppo import action_logps
from llmtrain.models.heads import captured_token_scores
from llmtrain.parallel import all_gather_rows
from llmtrain.stages.ppo.rollout import Rollout, model_inputs


@dataclass
class Experience:
    sequences: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long
    action_mask: torch.Tensor  # (B, A) bool
    old_logps: torch.Tensor  # (B, A) fp32: the actor's log-probs at rollout time (0 off the mask)
    ref_logps: torch.Tensor  # (B, A) fp32: the reference's
    values: torch.Tensor  # (B, A) fp32: the critic's V_t (zeros without a critic)
    token_rewards: torch.Tensor  # (B, A) fp32: −β·KL_t, plus the score at the last action token
    advantages: torch.Tensor  # (B, A) fp32 (whitened when asked)
    returns: torch.Tensor  # (B, A) fp32: advantages + values before whitening (zeros without a critic)
    scores: torch.Tensor  # (B,) fp32: the shaped score of each sequence
    kl: torch.Tensor  # (B, A) fp32: the per-token KL estimate in the reward (0 off the mask)

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    def select(self, index: torch.Tensor) -> "Experience":
        return Experience(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def trimmed(self) -> "Experience":
        """The same rows without the columns no row uses: left prompt padding and right response padding."""
        used = self.attention_mask.bool().any(0)  # (T,)
        first = int(used.nonzero()[0]) if used.any() else 0
        width = self.sequences.shape[1]
        last_action = int(self.action_mask.any(0).nonzero()[-1]) + 1 if self.action_mask.any() else 1
        cut = self.num_actions - last_action  # response columns after every row's last action
        values = {}
        for f in fields(self):
            tensor = getattr(self, f.name)
            if tensor.dim() == 2 and tensor.shape[1] == width:
                values[f.name] = tensor[:, first:width - cut]
            elif tensor.dim() == 2:
                values[f.name] = tensor[:, :last_action]
            else:
                values[f.name] = tensor
        return Experience(**values)

    def micro_batches(self, size: int) -> list["Experience"]:
        rows = self.sequences.shape[0]
        return [self.select(torch.arange(i, min(i + size, rows), device=self.sequences.device)).trimmed()
                for i in range(0, rows, size)]


def gather_experience(local: Experience, group=None) -> Experience:
    """Every dp rank's experience, in rank order (rank r's rows r·B .. (r+1)·B − 1), on every rank: the
    update's mini-batches are drawn from the global batch. Widths agree across ranks already (rollout)."""
    return Experience(**{f.name: all_gather_rows(getattr(local, f.name), group) for f in fields(local)})


@dataclass(frozen=True)
class ExperienceSettings:
    temperature: float
    kl_estimator: str
    kl_in_reward: bool
    advantage: str
    gamma: float
    lam: float
    whiten_advantages: bool
    group_size: int
    micro_batch_size: int


def _chunks(rows: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


@torch.no_grad()
def policy_logps(engine, rollout: Rollout, rows: slice, temperature: float) -> torch.Tensor:
    sequences, mask = rollout.sequences[rows], rollout.attention_mask[rows]
    with engine.autocast():
        logits = engine.module(**model_inputs(sequences, mask)).logits  # (b, T, V)
    return action_logps(logits, sequences, rollout.num_actions, temperature) * rollout.action_mask[rows]


@torch.no_grad()
def critic_values(engine, rollout: Rollout, rows: slice) -> torch.Tensor:
    sequences, mask = rollout.sequences[rows], rollout.attention_mask[rows]
    with engine.autocast(), captured_token_scores(engine.model) as captured:
        engine.module(**model_inputs(sequences, mask))
    values = captured[-1].float()[:, -rollout.num_actions - 1:-1]  # (b, A): V_t from the state before action t
    return values * rollout.action_mask[rows]


def make_experience(rollout: Rollout, engines: dict, scores: torch.Tensor, kl_coef: float,
                    settings: ExperienceSettings, group=None) -> Experience:
    """`scores` (B,): the shaped scores. Forwards run in micro-batches; every rank runs as many (sharded
    engines gather in each forward)."""
    for name in ("actor", "reference", "critic"):
        if name in engines:
            engines[name].module.eval()
    parts = _chunks(rollout.sequences.shape[0], settings.micro_batch_size)
    old = torch.cat([policy_logps(engines["actor"], rollout, rows, settings.temperature) for rows in parts])
    ref = torch.cat([policy_logps(engines["reference"], rollout, rows, settings.temperature) for rows in parts])
    mask = rollout.action_mask
    if "critic" in engines:
        values = torch.cat([critic_values(engines["critic"], rollout, rows) for rows in parts])
    else:
        values = torch.zeros_like(old)
    kl = KL_ESTIMATORS[settings.kl_estimator](old, ref) * mask  # (B, A)
    rewards = token_rewards(kl, scores, mask, kl_coef if settings.kl_in_reward else 0.0)
    advantages, returns = ADVANTAGE_ESTIMATORS[settings.advantage](AdvantageInputs(
        token_rewards=rewards, values=values if "critic" in engines else None, mask=mask, scores=scores,
        group_size=settings.group_size, gamma=settings.gamma, lam=settings.lam))
    if settings.whiten_advantages:
        advantages = whiten(advantages, mask, group=group)
    return Experience(sequences=rollout.sequences, attention_mask=rollout.attention_mask, action_mask=mask,
                      old_logps=old, ref_logps=ref, values=values, token_rewards=rewards, advantages=advantages,
                      returns=torch.zeros_like(old) if returns is None else returns, scores=scores, kl=kl)
