"""Experience: everything PPO's update reads about a rollout, computed once, before the update.

Every rank holds the whole global batch (the rollouts of all dp ranks, gathered, rank r's rows after rank
r−1's): the update's mini-batches are drawn from it by a seeded permutation. The forwards that make the
experience (old actor log-probs, reference log-probs, values) run in exactly the micro-batches the first
epoch of the update will run (the same rows, trimmed the same way) and each rank runs its own share; so
the first mini-batch's ratio is exactly 1, bit for bit, and the results are summed over ranks (each row is
computed by one rank). Log-probs of the actor and the reference take the same temperature, position ids
and no dropout as the update's own. Values: V_t from the hidden state before action t (`[:, -A-1:-1]`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from llmtrain.distributed import all_gather_rows, all_reduce_sum
from llmtrain.losses.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, token_rewards, whiten
from llmtrain.losses.importance import importance_weights
from llmtrain.losses.kl import KL_ESTIMATORS
from llmtrain.models.heads import captured_token_scores
from llmtrain.stages.head import action_answer
from llmtrain.stages.ppo.packed import ActionRows, action_rows, action_values
from llmtrain.stages.ppo.rollout import Rollout


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
    scores: torch.Tensor  # (B,) fp32: the shaped score of each sequence; NaN: no reward function scored it
    kl: torch.Tensor  # (B, A) fp32: the per-token KL estimate of the rollout (0 off the sampled action tokens)
    ended: torch.Tensor  # (B,) bool: the response ends in a stop token (False: cut at max_new_tokens)
    engine_logps: torch.Tensor | None = None  # (B, A) fp32: each action's log-prob as the engine sampled it (None: 0)
    is_weights: torch.Tensor | None = None  # (B, A) fp32: π_old / π_engine (ppo.importance_sampling; None: 1)

    def __post_init__(self):
        if self.engine_logps is None:
            self.engine_logps = torch.zeros_like(self.old_logps)
        if self.is_weights is None:
            self.is_weights = torch.ones_like(self.old_logps)

    @classmethod
    def of_rollout(cls, rollout: Rollout, scores: torch.Tensor) -> Experience:
        """The rollout's tensors with every computed field still zero."""
        def zeros() -> torch.Tensor:
            return torch.zeros(rollout.action_mask.shape, device=rollout.sequences.device)

        return cls(sequences=rollout.sequences, attention_mask=rollout.attention_mask, action_mask=rollout.action_mask,
                   old_logps=zeros(), ref_logps=zeros(), values=zeros(), token_rewards=zeros(), advantages=zeros(),
                   returns=zeros(), scores=scores.float(), kl=zeros(), ended=rollout.ended,
                   engine_logps=None if rollout.engine_logps is None else rollout.engine_logps.float())

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    @property
    def sampled_mask(self) -> torch.Tensor:
        """(B, A) bool: the action tokens as sampled, before ppo.mask_truncated took a cut response's away (the
        attention mask keeps them: 1 on prompt and action tokens)."""
        return self.attention_mask[:, -self.num_actions:].bool()

    def select(self, index: torch.Tensor) -> Experience:
        return Experience(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def trimmed(self) -> Experience:
        """The same rows without the columns none of them uses: left prompt padding, right response padding."""
        width = self.sequences.shape[1]
        used = self.attention_mask.bool().any(0)  # (T,)
        first = int(used.nonzero()[0]) if used.any() else 0
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


def gather_rollout(rollout: Rollout, scores: torch.Tensor, group=None) -> Experience:
    """Every dp rank's rollout and scores, in rank order, on every rank (widths agree across ranks already)."""
    local = Experience.of_rollout(rollout, scores)
    return Experience(**{f.name: all_gather_rows(getattr(local, f.name), group) for f in fields(local)})


def update_layout(order: torch.Tensor, mini_batch_size: int, micro_batch_size: int, dp_rank: int,
                  dp_size: int) -> list[list[torch.Tensor]]:
    """For one epoch's permutation `order` of the global rows: per mini-batch, this rank's micro-batches (row
    indices). A mini-batch is `mini_batch_size` consecutive entries of `order`; rank r takes every dp-th."""
    layout = []
    for k in range(0, len(order), mini_batch_size):
        mine = order[k:k + mini_batch_size][dp_rank::dp_size]
        layout.append([mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)])
    return layout


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
    scale_rewards: str = "group"
    mask_truncated: bool = False  # a response cut at max_new_tokens trains nothing (its score still counts)
    # One optimizer step per rollout and no KL in the reward (GRPO's usual setting, TRL's default): the update's
    # own forward gives the old log-probs (ratio 1 by construction), so the experience skips the actor's forward.
    old_logps_from_update: bool = False
    # ppo.old_logprobs=engine: the ratio's old log-probs are the engine's own (no actor forward here)
    old_logps_from_engine: bool = False
    # ppo.importance_sampling, resolved: (mode, clip_max, clip_min) of losses/importance.py, or None (weights 1)
    importance: tuple | None = None
    # ppo.packing: the attention that packs each micro-batch into one row (stages/ppo/packed.py); None: padded rows.
    # The update reads the same setting, so its first forward sees the experience's layout (first ratio exactly 1)
    packed_attention: str | None = None


def forward_rows(mb: Experience, packed_attention: str | None) -> ActionRows:
    """The forward inputs of a micro-batch: its padded rows, or one packed row (ppo.packing)."""
    return action_rows(mb.sequences, mb.attention_mask, mb.num_actions, packed_attention)


@torch.no_grad()
def policy_logps(engine, mb: Experience, temperature: float, rows: ActionRows) -> torch.Tensor:
    """(b, A) fp32 log-probs of the actions under the engine's model (0 off the mask); rows: forward_rows(mb, ...)."""
    with engine.autocast():
        answer = action_answer(engine.module, rows.inputs, mb.sequences, mb.num_actions, temperature,
                               states=rows.states)
    return answer.logps * mb.action_mask


def values_of(forward, model: torch.nn.Module, mb: Experience, rows: ActionRows) -> torch.Tensor:
    """(b, A) fp32 V_t from the critic's per-token scores at the state before each action (0 off the mask)."""
    with captured_token_scores(model) as captured:
        forward(**rows.inputs)
    return action_values(captured[-1].float(), rows, mb.num_actions) * mb.action_mask


def make_experience(exp: Experience, engines: dict, micro_batches: list[torch.Tensor], kl_coef: float,
                    settings: ExperienceSettings, group=None) -> Experience:
    """Fill `exp` (the gathered rollout with its scores): this rank's forwards over `micro_batches` (the rows of
    the first epoch's micro-batches on this rank, in order), summed over ranks, then KL, rewards, advantages."""
    for name in ("actor", "reference", "critic"):
        if name in engines:
            engines[name].module.eval()
    old, ref, values = (torch.zeros_like(exp.old_logps) for _ in range(3))
    for rows in micro_batches:
        mb = exp.select(rows).trimmed()
        width, inputs = mb.num_actions, forward_rows(mb, settings.packed_attention)  # packed once for every role
        if not (settings.old_logps_from_update or settings.old_logps_from_engine):
            old[rows, :width] = policy_logps(engines["actor"], mb, settings.temperature, inputs)
        if "reference" in engines:  # none when β = 0: the KL is then 0
            ref[rows, :width] = policy_logps(engines["reference"], mb, settings.temperature, inputs)
        if "critic" in engines:
            critic = engines["critic"]
            with torch.no_grad(), critic.autocast():
                values[rows, :width] = values_of(critic.module, critic.model, mb, inputs)
    old, ref, values = all_reduce_sum(torch.stack([old, ref, values]), group).unbind()  # each row from one rank
    mask = exp.action_mask
    if settings.old_logps_from_engine:
        old = exp.engine_logps.clone()
    is_weights = exp.is_weights
    if settings.importance is not None:
        mode, clip_max, clip_min = settings.importance
        is_weights = importance_weights(old, exp.engine_logps, mask, mode, clip_max, clip_min)
    kl = KL_ESTIMATORS[settings.kl_estimator](old, ref) * mask  # (B, A)
    if settings.old_logps_from_update or "reference" not in engines:
        kl = torch.zeros_like(kl)  # not in the reward; the update logs it from its own forward
    scored = ~exp.scores.isnan()  # (B,): NaN is an unscored row (rewards.combined_scores); here it becomes 0 + a flag
    scores = torch.where(scored, exp.scores, 0.0)
    rewards = token_rewards(kl, scores, mask, kl_coef if settings.kl_in_reward else 0.0)
    advantages, returns = ADVANTAGE_ESTIMATORS[settings.advantage](AdvantageInputs(
        token_rewards=rewards, values=values if "critic" in engines else None, mask=mask, scores=scores,
        group_size=settings.group_size, gamma=settings.gamma, lam=settings.lam, scale_rewards=settings.scale_rewards,
        scored=scored))
    trained = mask & scored.unsqueeze(1)  # an unscored row learns nothing from its advantage (TRL: 0)
    if settings.whiten_advantages:
        advantages = whiten(advantages, trained, reduce=False)  # over the scored rows of the global batch, every rank
    advantages = torch.where(trained, advantages, 0.0)
    made = Experience(sequences=exp.sequences, attention_mask=exp.attention_mask, action_mask=mask, old_logps=old,
                      ref_logps=ref, values=values, token_rewards=rewards, advantages=advantages,
                      returns=torch.zeros_like(old) if returns is None else returns, scores=exp.scores, kl=kl,
                      ended=exp.ended, engine_logps=exp.engine_logps, is_weights=is_weights)
    return without_truncated(made) if settings.mask_truncated else made


def without_truncated(exp: Experience) -> Experience:
    """TRL's mask_truncated_completions: a response cut at max_new_tokens gets no action token (no policy, value or
    KL loss); its score already counted in its group's statistics and the whitening. What describes the rollout as
    sampled stays: the attention mask (`sampled_mask`) and the KL estimate, which the logged metrics read."""
    mask = exp.action_mask & exp.ended.unsqueeze(1)  # (B, A)
    kept = {name: torch.where(mask, getattr(exp, name), 0.0) for name in
            ("old_logps", "ref_logps", "values", "token_rewards", "advantages", "returns")}
    return replace(exp, action_mask=mask, **kept)
