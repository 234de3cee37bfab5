"""SimPO: a trainable policy on pairs of responses, with no reference model (Meng et al. 2024).

One role, "policy" (trainable). A response's reward is β·a, a = log π(y|x) / |y| its log-prob averaged over its
target tokens; the loss of a step is Σ_pairs −logsigmoid(β·(a_c − a_r) − γ) / pairs in the global batch
(`losses/reference_free.py`: `simpo.gamma` is γ, TRL's `simpo_gamma`; a `gamma_beta_ratio` elsewhere is γ/β).
Equal log-probs cost softplus(γ) per pair. `logp_chosen` / `logp_rejected` are the length-averaged log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from llmtrain.losses.dpo import DPO_STATS, dpo_metrics, dpo_stat_sums
from llmtrain.losses.reference_free import SimPOTerms, simpo_terms
from llmtrain.stages.base import ModelSource, Stage, Updater, eval_totals
from llmtrain.stages.causal_lm import policy_role
from llmtrain.stages.head import pair_logps, routed_update, with_router
from llmtrain.stages.preference import (
    PairBatch,
    collate_pairs,
    padding_free_for,
    pair_problems,
    pair_spec,
    reward_eval_metrics,
    reward_eval_sums,
)
from llmtrain.stages.spec import ImplicitReward


@dataclass
class SimPOConfig:
    """stage=simpo: −logsigmoid(β·(a_c − a_r) − γ) on length-averaged log-probs a, no reference model."""
    beta: float = 2.0  # the SimPO paper's range: 2.0 to 2.5 (DPO's 0.1 is far too small here)
    gamma: float = 1.0  # target reward margin γ (the SimPO authors' γ/β is about 0.5: γ ≈ 1 at β = 2)


class SimPOStage(Stage):
    name = "simpo"
    count_name = "pairs"

    def __init__(self, source: ModelSource, pad_token_id: int, *, beta: float, gamma: float,
                 padding_free: bool = False):
        self.roles = policy_role(None, source)
        self.collate = partial(collate_pairs, pad_token_id=pad_token_id, padding_free=padding_free)
        self.beta, self.gamma = beta, gamma

    def logps(self, forward, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen (P,), rejected (P,)) length-averaged response log-probs, fp32."""
        return batch.split(pair_logps(forward, batch, average=True)[0])

    def routed_logps(self, module, batch: PairBatch):
        """`logps` with the MoE routers' term and statistics of the forward."""
        sums, term, stats = pair_logps(module, batch, average=True, route=True)
        return batch.split(sums), term, stats

    def terms(self, logps: tuple[torch.Tensor, torch.Tensor]) -> SimPOTerms:
        return simpo_terms(*logps, beta=self.beta, gamma=self.gamma)

    def train_step(self, micro_batches: list[PairBatch], engines: dict, updater: Updater) -> dict:
        def micro_loss(module, batch: PairBatch):
            logps, term, router_stats = self.routed_logps(module, batch)  # MoE: + coef × router aux loss
            terms = self.terms(logps)
            share = batch.share  # under sp each pair counts on one peer (stages/pair_shard.py); 1 without
            return with_router(terms.losses.sum() * share, dpo_stat_sums(terms, *logps) * share, term, router_stats)

        pairs = sum(b.num_pairs for b in micro_batches)
        result, routed = routed_update(updater, engines["policy"], micro_batches, micro_loss, pairs, len(DPO_STATS))
        metrics = dpo_metrics(dict(zip(DPO_STATS, result.sums)), max(result.count, 1))
        return {"loss": result.loss, **metrics, "lr": result.lr, "grad_norm": result.grad_norm, "pairs": result.count,
                **routed}

    @torch.no_grad()
    def evaluate(self, batches, engines: dict) -> dict:
        policy = engines["policy"]
        policy.module.eval()
        sums = eval_totals(policy, batches, lambda module, batch: reward_eval_sums(  # loss, correct, margin, pairs
            self.terms(self.logps(module, batch)), batch), 4)
        return reward_eval_metrics(sums)


def build(cfg, source: ModelSource, tokenizer, attn_implementation: str) -> SimPOStage:
    return SimPOStage(source, tokenizer.pad_token_id, beta=cfg.simpo.beta, gamma=cfg.simpo.gamma,
                      padding_free=padding_free_for(attn_implementation))


def problems(cfg, dp: int) -> list[str]:
    s, found = cfg.simpo, pair_problems(cfg, "simpo")
    if not s.beta > 0:
        found.append(f"simpo.beta={s.beta} must be > 0 (typical: 2.0 to 2.5; it scales the length-averaged reward)")
    if not s.gamma >= 0:
        found.append(f"simpo.gamma={s.gamma} must be >= 0 (the target reward margin; typical: 0.5 to 2)")
    return found


def implicit_reward(cfg) -> ImplicitReward:
    return ImplicitReward(beta=cfg.simpo.beta, averaged=True, reference=False)


STAGE_SPECS = (pair_spec(name="simpo", build=build, roles=policy_role, metric_group="simpo", config_node="simpo",
                         config_class=SimPOConfig, problems=problems, pair_scores="implicit",
                         implicit_reward=implicit_reward, sequence_parallel=True),)
