"""ORPO: supervised fine-tuning on the chosen responses plus an odds-ratio preference term (Hong et al. 2024).

One role, "policy" (trainable), no reference model. Loss of a step:
    Σ_chosen-tokens −log π(token) / chosen target tokens in the global batch
  + β · Σ_pairs −logsigmoid(log odds(a_c) − log odds(a_r)) / pairs in the global batch,
with a = log π(y|x) / |y| the response's log-prob averaged over its target tokens and odds(a) = e^a / (1 − e^a)
(`losses/reference_free.py`). The NLL is the SFT loss of the chosen responses (response tokens only; TRL's
ORPOTrainer also counts the prompt's). Logged as TRL does: rewards β·a, `log_odds_ratio` the mean of
logsigmoid(log_odds), `log_odds_chosen` the mean log_odds, `nll_loss`; `logp_*` are the length-averaged log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from llmtrain.data.sequence_shard import RowShare
from llmtrain.distributed import all_reduce_sum
from llmtrain.losses.dpo import DPO_STATS, dpo_metrics, dpo_stat_sums
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.losses.reference_free import ORPOTerms, orpo_terms
from llmtrain.stages.base import ModelSource, Stage, Updater, eval_totals
from llmtrain.stages.causal_lm import policy_role
from llmtrain.stages.head import pair_totals, routed_update, with_router
from llmtrain.stages.preference import PairBatch, collate_pairs, padding_free_for, pair_problems, pair_spec
from llmtrain.stages.spec import ImplicitReward

# Sums of a step after DPO_STATS: the chosen responses' NLL, Σ log_odds, Σ logsigmoid(log_odds).
ORPO_STATS = ("nll_sum", "log_odds_chosen", "log_odds_ratio")


@dataclass
class ORPOConfig:
    """stage=orpo: NLL of the chosen responses + β·(−logsigmoid(log odds ratio)), no reference model."""
    beta: float = 0.1  # λ of the paper (0.1 there and in TRL), the weight of the odds-ratio term


@dataclass
class ORPOPairBatch(PairBatch):
    num_chosen_targets: int = 0  # target tokens of the chosen responses (0 for filler pairs), counted on the host

    def sequence_shard(self, attn_implementation: str, rows: RowShare) -> ORPOPairBatch:
        shard = super().sequence_shard(attn_implementation, rows)
        return replace(shard, num_chosen_targets=self.num_chosen_targets if shard.share else 0)  # counted once


def sequence_target_counts(labels: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """(num_sequences,) long: each sequence's target tokens, the ones `packed_sequence_logps` sums over.

    labels, sequence_ids: (R, T); a log-prob counts for the sequence of the token it predicts (position t + 1)."""
    owner = sequence_ids[:, 1:]  # (R, T-1)
    kept = (labels[:, 1:] != IGNORE_INDEX) & (owner >= 0)  # (R, T-1)
    return torch.bincount(owner[kept], minlength=num_sequences)


def collate_orpo_pairs(examples: list[dict], pad_token_id: int, padding_free: bool = False) -> ORPOPairBatch:
    batch = collate_pairs(examples, pad_token_id=pad_token_id, padding_free=padding_free)
    counts = sequence_target_counts(batch.rows.labels, batch.sequence_ids, batch.num_sequences)  # (2P,)
    return ORPOPairBatch(**vars(batch), num_chosen_targets=int(batch.split(counts)[0].sum()))


class ORPOStage(Stage):
    name = "orpo"
    count_name = "pairs"

    def __init__(self, source: ModelSource, pad_token_id: int, *, beta: float, padding_free: bool = False):
        self.roles = policy_role(None, source)
        self.collate = partial(collate_orpo_pairs, pad_token_id=pad_token_id, padding_free=padding_free)
        self.beta = beta

    def logps(self, forward, batch: ORPOPairBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen summed (P,), chosen averaged (P,), rejected averaged (P,)) response log-probs, fp32: one forward."""
        return self.routed_logps(forward, batch)[0]

    def routed_logps(self, module, batch: ORPOPairBatch, route: bool = False):
        """(`logps`, the MoE routers' term, their statistics) of one forward (route=False: no router terms)."""
        sums, counts, term, stats = pair_totals(module, batch, route=route)  # (2P,) each, whole sequences'
        means = sums / counts.clamp(min=1)  # (2P,) as average=True
        return (batch.split(sums)[0], *batch.split(means)), term, stats

    def terms(self, chosen: torch.Tensor, rejected: torch.Tensor) -> ORPOTerms:
        return orpo_terms(chosen, rejected, beta=self.beta)

    def train_step(self, micro_batches: list[ORPOPairBatch], engines: dict, updater: Updater) -> dict:
        policy = engines["policy"]
        pairs = sum(b.num_pairs for b in micro_batches)
        tokens = sum(b.num_chosen_targets for b in micro_batches)
        # Two normalisers: the Updater divides every micro-batch's loss sum by the global pairs, but the NLL must be
        # divided by the global chosen target tokens. So the NLL sum enters scaled by global_pairs / global_tokens:
        # after the Updater's 1 / global_pairs it is NLL_sum / global_tokens, while the odds-ratio sum keeps its
        # 1 / global_pairs. Both counts are reduced here, on the host's numbers, before the first forward.
        counts = torch.tensor([pairs, tokens], dtype=torch.float64, device=updater.device)
        global_pairs, global_tokens = all_reduce_sum(counts, policy.dp_group).tolist()
        nll_scale = global_pairs / max(global_tokens, 1.0)

        def micro_loss(module, batch: ORPOPairBatch):
            (chosen_sum, chosen, rejected), term, router_stats = self.routed_logps(module, batch, route=True)
            terms = self.terms(chosen, rejected)
            nll_sum = -chosen_sum.sum()
            stats = torch.stack([nll_sum.detach().double(), terms.log_odds.double().sum(),
                                 F.logsigmoid(terms.log_odds).double().sum()])
            # batch.share: under sp each pair counts on one peer (stages/pair_shard.py); 1 without
            return with_router((nll_sum * nll_scale + terms.losses.sum()) * batch.share,
                               torch.cat([dpo_stat_sums(terms, chosen, rejected), stats]) * batch.share, term,
                               router_stats)

        result, routed = routed_update(updater, policy, micro_batches, micro_loss, pairs, len(DPO_STATS + ORPO_STATS))
        sums, num_pairs = dict(zip(DPO_STATS + ORPO_STATS, result.sums)), max(result.count, 1)
        return {"loss": result.loss, **dpo_metrics(sums, num_pairs),
                "nll_loss": sums["nll_sum"] / max(global_tokens, 1.0),
                "log_odds_chosen": sums["log_odds_chosen"] / num_pairs,
                "log_odds_ratio": sums["log_odds_ratio"] / num_pairs,
                "lr": result.lr, "grad_norm": result.grad_norm, "pairs": result.count, **routed}

    @torch.no_grad()
    def evaluate(self, batches, engines: dict) -> dict:
        policy = engines["policy"]
        policy.module.eval()
        nll, ratio, correct, margin, pairs, tokens = eval_totals(policy, batches, self.eval_sums, 6)
        pairs, tokens = max(pairs, 1), max(tokens, 1)
        return {"eval_loss": nll / tokens + ratio / pairs, "eval_nll_loss": nll / tokens,
                "eval_reward_accuracy": correct / pairs, "eval_reward_margin": margin / pairs,
                "eval_pairs": int(pairs)}


    def eval_sums(self, module, batch: ORPOPairBatch) -> torch.Tensor:
        """(6,) fp64: NLL, odds-ratio loss, correct, margin, pairs, chosen target tokens of one batch."""
        chosen_sum, chosen, rejected = self.logps(module, batch)
        terms = self.terms(chosen, rejected)
        w = batch.counted.double()  # (P,) 0 for a filler pair (labels all masked: no NLL, no tokens), sp peers
        margin = (terms.chosen_rewards - terms.rejected_rewards).double()  # (P,)
        return torch.stack([-chosen_sum.double().sum() * batch.share, (terms.losses.double() * w).sum(),
                            ((margin > 0).double() * w).sum(), (margin * w).sum(), w.sum(),
                            torch.tensor(float(batch.num_chosen_targets), dtype=torch.float64, device=w.device)])


def build(cfg, source: ModelSource, tokenizer, attn_implementation: str) -> ORPOStage:
    return ORPOStage(source, tokenizer.pad_token_id, beta=cfg.orpo.beta,
                     padding_free=padding_free_for(attn_implementation))


def problems(cfg, dp: int) -> list[str]:
    found = pair_problems(cfg, "orpo")
    if not cfg.orpo.beta > 0:
        found.append(f"orpo.beta={cfg.orpo.beta} must be > 0 (typical: 0.1; with 0 it is SFT on the chosen "
                     "responses: use stage=sft)")
    return found


def implicit_reward(cfg) -> ImplicitReward:
    return ImplicitReward(beta=cfg.orpo.beta, averaged=True, reference=False)


STAGE_SPECS = (pair_spec(name="orpo", build=build, roles=policy_role, metric_group="orpo", config_node="orpo",
                         config_class=ORPOConfig, problems=problems, pair_scores="implicit",
                         implicit_reward=implicit_reward, sequence_parallel=True),)
