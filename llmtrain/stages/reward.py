"""Reward model: a scalar head on a causal-LM backbone, trained on pairs with the pairwise loss.

One trainable role "reward" (`AutoModelForSequenceClassification`, one label). Each sequence is scored at
its EOS (its last real token, from the lengths: never from the pad id), and the loss of a step is
Σ_pairs [-logsigmoid(r_c − r_r − margin) + center_coef·(r_c + r_r)²] / pairs in the global batch.
The last eval's reward mean and std over every held-out sequence go into the exported config
(`reward_mean`, `reward_std`), for a later PPO run to normalise with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from llmtrain.losses.pairwise import PAIRWISE_STATS, pairwise_loss_sum, pairwise_metrics, pairwise_stat_sums
from llmtrain.models.heads import scores_at
from llmtrain.models.load import use_distinct_pad_token
from llmtrain.models.moe import captured_router_logits, router_of, router_terms
from llmtrain.stages.base import ModelSource, RoleSpec, Stage, Updater, eval_totals
from llmtrain.stages.head import routed_update, with_router
from llmtrain.stages.preference import PairBatch, collate_pairs, padding_free_for, pair_problems, pair_spec

ROLE = "reward"


@dataclass
class RewardConfig:
    """stage=reward: pairwise loss -logsigmoid(r_chosen - r_rejected - margin) + center_coef·(r_c + r_r)²."""
    margin_column: Optional[str] = None  # a data column with a per-pair margin (null: no margin)
    center_coef: float = 0.0  # > 0 pulls the rewards' mean towards 0 (Eisenstein et al.; TRL's center_rewards)


class RewardStage(Stage):
    name = "reward"
    count_name = "pairs"

    def __init__(self, source: ModelSource, pad_token_id: int, center_coef: float = 0.0, padding_free: bool = False):
        self.roles = reward_role(None, source)
        self.collate = partial(collate_pairs, pad_token_id=pad_token_id, padding_free=padding_free)
        self.center_coef = center_coef
        self.reward_stats: dict[str, float] = {}  # the last eval's reward mean / std

    def scores(self, engine, forward, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(r_chosen (P,), r_rejected (P,)) in fp32, from one forward of the 2P rows (`forward`: the engine's module,
        or under backend.pp the last stage's view; the score layer is the engine's model's, on that stage). On a
        sequence shard each score is read by the one sp peer that holds the sequence's last token, and summed over
        the peers."""
        rewards = scores_at(forward, engine.model, batch.ends, **batch.rows.model_inputs())  # (2P,) 0 elsewhere
        return batch.split(batch.whole(rewards))

    def routed_scores(self, engine, forward, batch: PairBatch):
        """`scores`, with an MoE model's routers' term and statistics (None, None for a dense one)."""
        router = router_of(engine.module)
        if router is None:
            return self.scores(engine, forward, batch), None, None
        with captured_router_logits(engine.model) as router_logits:
            rewards = scores_at(forward, engine.model, batch.ends, **batch.rows.model_inputs(),
                                output_router_logits=True)  # (2P,)
        return (batch.split(batch.whole(rewards)), *router_terms(router, router_logits[-1], batch.rows.token_mask()))

    def train_step(self, micro_batches: list[PairBatch], engines: dict, updater: Updater) -> dict:
        engine = engines[ROLE]

        def micro_loss(module, batch: PairBatch):
            (chosen, rejected), term, router_stats = self.routed_scores(engine, module, batch)  # MoE: + coef × aux
            loss = pairwise_loss_sum(chosen, rejected, batch.margin, self.center_coef)
            share = batch.share  # under sp each pair counts on one peer (stages/pair_shard.py); 1 without
            return with_router(loss * share, pairwise_stat_sums(chosen, rejected) * share, term, router_stats)

        pairs = sum(b.num_pairs for b in micro_batches)
        result, routed = routed_update(updater, engine, micro_batches, micro_loss, pairs, len(PAIRWISE_STATS))
        metrics = pairwise_metrics(dict(zip(PAIRWISE_STATS, result.sums)), max(result.count, 1))
        return {"loss": result.loss, **metrics, "lr": result.lr, "grad_norm": result.grad_norm, "pairs": result.count,
                **routed}

    @torch.no_grad()
    def evaluate(self, batches, engines: dict) -> dict:
        engine = engines[ROLE]
        engine.module.eval()
        names = ("loss", "pairs", "margin", "correct_easy", "easy", "correct_hard", "hard", "reward_sum",
                 "reward_sq")
        totals = dict(zip(names, eval_totals(engine, batches, lambda module, batch: eval_sums(
            *self.scores(engine, module, batch), batch), len(names))))
        pairs = max(totals["pairs"], 1)
        mean = totals["reward_sum"] / (2 * pairs)
        self.reward_stats = {"reward_mean": mean,
                             "reward_std": math.sqrt(max(totals["reward_sq"] / (2 * pairs) - mean**2, 0.0))}
        record = {"eval_loss": totals["loss"] / pairs, "eval_accuracy": totals["correct_easy"] / max(totals["easy"], 1),
                  "eval_margin": totals["margin"] / pairs, "eval_pairs": int(totals["pairs"]),
                  **{f"eval_{k}": v for k, v in self.reward_stats.items()}}
        if totals["hard"]:
            record["eval_accuracy_hard"] = totals["correct_hard"] / totals["hard"]
        return record

    def export_config(self, role: str) -> dict:
        return dict(self.reward_stats)

    def state_dict(self) -> dict:
        return {"reward_stats": self.reward_stats}

    def load_state_dict(self, state: dict) -> None:
        self.reward_stats = dict(state.get("reward_stats", {}))


def eval_sums(chosen: torch.Tensor, rejected: torch.Tensor, batch: PairBatch) -> torch.Tensor:
    """Sums over the real pairs (filler weight 0): loss, pairs, margin, correct/count of easy (not tagged
    hard) and hard pairs, Σr and Σr² over both sides."""
    w, hard = batch.counted.double(), batch.hard  # counted: 0 for filler pairs, and on sp peers
    losses = torch.nn.functional.softplus(-(chosen - rejected - batch.margin)).double()  # -logsigmoid(x)
    correct = (chosen > rejected).double() * w
    both = torch.cat([chosen, rejected]).double()
    return torch.stack([(losses * w).sum(), w.sum(), ((chosen - rejected).double() * w).sum(),
                        (correct * ~hard).sum(), (w * ~hard).sum(), (correct * hard).sum(), (w * hard).sum(),
                        (both * w.repeat(2)).sum(), (both**2 * w.repeat(2)).sum()])


def build(cfg, source: ModelSource, tokenizer, attn_implementation: str) -> RewardStage:
    use_distinct_pad_token(tokenizer)  # so the exported model pools at the EOS in transformers too
    return RewardStage(source, tokenizer.pad_token_id, cfg.reward.center_coef,
                       padding_free=padding_free_for(attn_implementation))


def reward_role(cfg, source: ModelSource) -> dict[str, RoleSpec]:
    return {ROLE: RoleSpec(source, head="scalar", trainable=True)}


def problems(cfg, dp: int) -> list[str]:
    found = pair_problems(cfg, "reward")
    if cfg.reward.center_coef < 0:
        found.append(f"reward.center_coef={cfg.reward.center_coef} must be >= 0")
    return found


def margin_column(cfg) -> dict[str, str]:
    """reward.margin_column: the data column read as each pair's margin."""
    column = cfg.reward.margin_column
    return {column: "margin"} if column else {}


STAGE_SPECS = (pair_spec(name="reward", build=build, roles=reward_role, metric_group="reward", config_node="reward",
                         config_class=RewardConfig, problems=problems, column_renames=margin_column,
                         pair_scores="scalar", sequence_parallel=True),)
