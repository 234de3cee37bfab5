"""PPO's update (and GRPO's): `epochs` passes over the global experience in mini-batches, each one optimizer step of
the actor (clipped surrogate) and of the critic (clipped value loss) through the shared Updater, losses being token
sums normalised by the action tokens of the global mini-batch (ppo.loss_agg says how); and the train-inference
mismatch measured on the way. PPOStage (stage.py) inherits it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from llmtrain.distributed import all_reduce_max
from llmtrain.losses.importance import mismatch_metrics
from llmtrain.losses.kl import KL_ESTIMATORS
from llmtrain.losses.ppo import (
    aggregation_weights,
    explained_variance,
    policy_loss_terms,
    value_clipped,
    value_loss_terms,
)
from llmtrain.models.moe import captured_router_logits, router_of, router_terms
from llmtrain.stages.base import Updater
from llmtrain.stages.head import action_answer, flat_actions, routed_update, with_router
from llmtrain.stages.ppo.experience import Experience, forward_rows, values_of
from llmtrain.stages.ppo.update_metrics import add_share, update_mismatch

POLICY_STATS = ("clipped", "approx_kl", "entropy", "kl_loss", "tokens")
VALUE_STATS = ("value_clipped",)


@dataclass(frozen=True)
class UpdateSettings:
    epochs: int
    mini_batch_size: int  # sequences per optimizer step, global
    clip_eps: float  # ε_low (and ε_high unless clip_eps_high)
    value_clip_eps: float | None
    value_coef: float
    entropy_coef: float
    kl_in_loss: bool  # β·KL is a loss term (GRPO), with β the KL controller's current value; else in the reward
    kl_estimator: str
    temperature: float
    clip_eps_high: float | None = None  # DAPO's clip-higher; None: clip_eps
    clip_ratio_c: float | None = None  # dual-clip; None: off
    ratio_level: str = "token"  # token | sequence (GSPO)
    loss_agg: str = "token_mean"  # losses/ppo.LOSS_AGGREGATIONS, resolved (resolve_loss_agg: null follows the ratio)
    max_new_tokens: int = 1  # dr_grpo's and seq_mean_token_sum_norm's constant L


class PPOUpdate:
    """The update half of PPOStage: it reads the stage's `update` (UpdateSettings), `experience`, `iteration`,
    `critic_warmup_steps`, `kl_loss_coef` and `has_reference`."""

    # ---- the train-inference mismatch --------------------------------------------------------------
    @property
    def _mismatch_in_experience(self) -> bool:
        """Where the trainer's log-probs at the rollout's weights are: the experience's actor forward, or (on the
        one-update shortcut, or with the engine's old log-probs) the update's first mini-batch forward."""
        return not (self.experience.old_logps_from_update or self.experience.old_logps_from_engine)

    def _mismatch(self, trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict:
        u = self.update
        return mismatch_metrics(trainer, engine, mask, u.clip_eps,
                                u.clip_eps if u.clip_eps_high is None else u.clip_eps_high)

    # ---- the update ------------------------------------------------------------------------------
    def _update(self, exp: Experience, engines: dict, updater: Updater, layouts: list) -> dict:
        actor = engines["actor"]
        critic = engines.get("critic")
        sums = {"policy_loss": 0.0, "value_loss": 0.0, "count": 0, "value_tokens": 0,
                **{k: 0.0 for k in POLICY_STATS + VALUE_STATS}}
        first_dev = [0.0]
        self._first_mismatch = []  # (metrics, action tokens) of each micro-batch of the first mini-batch
        last, router_sums = None, {}
        actor_frozen = self.iteration <= self.critic_warmup_steps  # ppo.critic.warmup_steps: the critic learns first
        for epoch, layout in enumerate(layouts):
            for k, micro_rows in enumerate(layout):
                micro = [exp.select(rows).trimmed() for rows in micro_rows]
                tokens = sum(int(mb.action_mask.sum()) for mb in micro)
                if not actor_frozen:
                    count = sum(self._aggregation(mb)[1] for mb in micro)  # tokens, or sequences (ppo.loss_agg)
                    track = first_dev if epoch == 0 and k == 0 else None
                    last, routed = routed_update(updater, actor, micro, partial(self._policy_loss, first_dev=track),
                                                 count, len(POLICY_STATS))
                    add_share(router_sums, routed, "", len(layouts) * len(layout))  # an MoE actor's routers
                    sums["policy_loss"] += last.loss * last.count
                    sums["count"] += last.count
                    for name, value in zip(POLICY_STATS, last.sums):
                        sums[name] += value
                if critic is not None:
                    value_loss = partial(self._value_loss, model=critic.model)
                    result, routed = routed_update(updater, critic, micro, value_loss, tokens, len(VALUE_STATS))
                    add_share(router_sums, routed, "critic_", len(layouts) * len(layout))  # logged apart
                    sums["value_loss"] += result.loss * result.count
                    sums["value_tokens"] += result.count
                    sums["value_clipped"] += result.sums[0]
        critic_metrics = {} if critic is None else {
            "value_loss": sums["value_loss"] / max(sums["value_tokens"], 1),
            "value_clip_frac": sums["value_clipped"] / max(sums["value_tokens"], 1),
            "explained_var": float(explained_variance(exp.values, exp.returns, exp.action_mask))}
        if actor_frozen:  # the critic's warm-up: no policy update, its loss and lr stand for the step's
            return {"loss": critic_metrics["value_loss"], **critic_metrics, "lr": result.lr,
                    "grad_norm": result.grad_norm, "actor_frozen": 1.0, **router_sums}
        tokens = max(sums["tokens"], 1)  # the global action tokens of every update, from the statistics
        first_ratio_dev = all_reduce_max(torch.tensor([first_dev[0]], dtype=torch.float64), None).item()
        policy_loss = sums["policy_loss"] / max(sums["count"], 1)  # aggregated as ppo.loss_agg says
        metrics = {"loss": policy_loss, "policy_loss": policy_loss,
                   "clip_frac": sums["clipped"] / tokens, "approx_kl": sums["approx_kl"] / tokens,
                   "entropy": sums["entropy"] / tokens, "lr": last.lr, "grad_norm": last.grad_norm, **router_sums}
        if not self.experience.old_logps_from_update:  # on the shortcut the ratio is 1 by construction: no measure
            metrics["first_ratio_dev"] = first_ratio_dev
        if not self._mismatch_in_experience:
            metrics.update(update_mismatch(self._first_mismatch, exp.sequences.device))
        if self.kl_loss_coef > 0:
            metrics["kl_loss"] = sums["kl_loss"] / tokens
        if self.experience.old_logps_from_update:  # the KL to the reference, from the update's forward
            sequences = max(int(exp.action_mask.any(-1).sum()), 1)  # the rows it saw (not ppo.mask_truncated's)
            metrics.update(kl=sums["kl_loss"] / sequences, kl_token=sums["kl_loss"] / tokens)
        return metrics | critic_metrics

    def _policy_loss(self, module, mb: Experience, first_dev: list | None = None):
        on_policy = self.experience.old_logps_from_update
        weights, _ = self._aggregation(mb)  # (b, A): 1, or per-sequence shares (ppo.loss_agg)
        weights = weights * mb.is_weights  # × π_old / π_engine (ppo.importance_sampling; 1 without)
        # token-level ratios: the loss is a sum of per-token terms, computed with its gradient inside the fused head;
        # GSPO's sequence ratio needs whole sequences, so its loss is taken from the head's log-probs
        token_loss = self._token_loss(mb, weights) if self.update.ratio_level == "token" else None
        rows = forward_rows(mb, self.experience.packed_attention)  # the layout the experience's forwards had
        answer, router_term, router_stats = action_answer(module, rows.inputs, mb.sequences, mb.num_actions,
                                                          self.update.temperature, entropy=True,
                                                          route=True,  # MoE: + coef × routers' aux
                                                          token_loss=token_loss, states=rows.states)
        logps = answer.logps  # (b, A)
        old = logps.detach() if on_policy else mb.old_logps
        if token_loss is None:
            loss, terms, entropy, kl = self._loss_terms(logps, answer.entropy, old, mb.advantages, mb.action_mask,
                                                        mb.ref_logps, weights)
        else:
            loss = answer.loss_sum
            with torch.no_grad():  # the statistics, from the same terms (logps are values here)
                _, terms, entropy, kl = self._loss_terms(logps, answer.entropy, old, mb.advantages, mb.action_mask,
                                                         mb.ref_logps, weights)
        mask = mb.action_mask
        if first_dev is not None:
            # against the old log-probs the ratio uses: the experience's forward (exactly 1 expected), or the engine's
            # (ppo.old_logprobs=engine); on the shortcut it is the update's own, logged not (mismatch_* measures it)
            deviation = ((logps.detach() - old).abs() * mask).max().item() if mask.any() else 0.0
            first_dev[0] = max(first_dev[0], deviation)
            if not self._mismatch_in_experience:  # the update's forward is the trainer's at the rollout's weights
                self._first_mismatch.append((self._mismatch(logps.detach(), mb.engine_logps, mask),
                                             int(mask.sum())))
        stats = torch.stack([terms.clipped.float().sum(), terms.approx_kl.sum(), entropy.detach().sum(),
                             kl.detach().sum(), mask.sum().float()])
        return with_router(loss, stats, router_term, router_stats)

    def _loss_terms(self, logp, entropy, old, advantages, mask, ref, weights):
        """The policy loss (0-d, weighted by ppo.loss_agg) and its parts: (loss, PolicyTerms, entropy on the mask,
        KL estimate on the mask), for (b, A) tensors or any run of flattened tokens (token-level ratios)."""
        u = self.update
        terms = policy_loss_terms(logp, old, advantages, mask, u.clip_eps, clip_eps_high=u.clip_eps_high,
                                  clip_ratio_c=u.clip_ratio_c, ratio_level=u.ratio_level)
        loss = (terms.losses * weights).sum()
        entropy = entropy * mask
        if u.entropy_coef > 0:
            loss = loss - u.entropy_coef * (entropy * weights).sum()
        kl = KL_ESTIMATORS[u.kl_estimator](logp, ref) * mask if self.has_reference else torch.zeros_like(logp)
        if self.kl_loss_coef > 0:
            loss = loss + self.kl_loss_coef * (kl * weights).sum()
        return loss, terms, entropy, kl

    def _token_loss(self, mb: Experience, weights: torch.Tensor):
        """The policy loss as a models/fused_head.TokenLoss over the head's b·(A + 1) positions."""
        on_policy = self.experience.old_logps_from_update
        old = None if on_policy else flat_actions(mb.old_logps)
        advantages, mask, ref = flat_actions(mb.advantages), flat_actions(mb.action_mask), flat_actions(mb.ref_logps)
        shares = flat_actions(weights)

        def token_loss(rows: slice, logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            previous = logp.detach() if old is None else old[rows]
            return self._loss_terms(logp, entropy, previous, advantages[rows], mask[rows], ref[rows], shares[rows])[0]

        return token_loss

    def _aggregation(self, mb: Experience) -> tuple[torch.Tensor, int]:
        return aggregation_weights(mb.action_mask, self.update.loss_agg, self.update.max_new_tokens,
                                   self.update.mini_batch_size)

    def _value_loss(self, module, mb: Experience, model: torch.nn.Module):
        """The critic's clipped value loss; an MoE critic adds its routers' aux loss (its sequence classifier drops
        the router logits: they are taken from its backbone, as the reward model's)."""
        u = self.update
        router = router_of(module)
        term = router_stats = None
        rows = forward_rows(mb, self.experience.packed_attention)
        if router is None:
            values = values_of(module, model, mb, rows)  # (b, A): the engine's model holds the score layer
        else:
            with captured_router_logits(model) as router_logits:
                values = values_of(partial(module, output_router_logits=True), model, mb, rows)
            term, router_stats = router_terms(router, router_logits[-1], rows.token_mask())
        losses = value_loss_terms(values, mb.values, mb.returns, mb.action_mask, u.value_clip_eps)
        clipped = value_clipped(values, mb.values, mb.returns, mb.action_mask, u.value_clip_eps)
        return with_router(u.value_coef * losses.sum(), clipped.float().sum().reshape(1), term, router_stats)
