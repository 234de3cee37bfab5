"""KTO: a trainable policy against a frozen reference, on unpaired completions marked desirable or undesirable
(Ethayarajh et al. 2024; TRL's KTOTrainer).

Roles as DPO's: "policy" (trainable) and "reference" (frozen; with peft=lora the policy with its adapters off), the
reference's log-probs computed in the step or once before training (kto.precompute_ref_logps, the table of
stages/reference_cache.py). Data: `unpaired` rows (prompt, completion, label), or `preference` pairs, each one
desirable and one undesirable row (data/unpaired_format.py). `trainer.micro_batch_size` counts completions.

A micro-batch of N completions is one forward over 2N sequences, the PairBatch layout of the pair stages: the N
completions first, then their N KL sequences (each row's prompt with the previous row's completion). A step:
1. the reference's log-probs of both halves, and the policy's of the KL half (no grad), over every micro-batch;
2. z0 = clamp(Σ (π − ref) over the global batch's KL sequences / their number, 0), one all-reduce (losses/kto.py);
3. the update: Σ weighted losses / completions in the global batch (the Updater).
Step 1 costs one no-grad forward of the policy more than TRL (which estimates z0 per micro-batch, in the same forward);
it is what makes z0 the global batch's, the same on every backend and layout.

Evaluation (held-out rows, layout-free): every rank's per-row log-ratios are gathered, z0 is the held-out set's, and
`eval_reward_accuracy` is the share of held-out PAIRS (rows unpaired from `preference` data) whose chosen completion's
implied reward β·(log π − log π_ref) beats the rejected one's, as DPO logs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from llmtrain.losses.kto import (
    KTO_LOSSES,
    KTO_STATS,
    USES_KL,
    kl_reference_point,
    kto_loss_terms,
    kto_metrics,
    kto_stat_sums,
    mismatched_kl_sum,
)
from llmtrain.parallel import degree_of
from llmtrain.stages.base import ModelSource, Updater, reduce_sums
from llmtrain.stages.dpo import DPOStage, dpo_roles, resumed_run_dir
from llmtrain.stages.head import routed_update, with_router
from llmtrain.stages.preference import PairBatch, collate_pairs, padding_free_for, pair_problems, pair_spec
from llmtrain.stages.reference_cache import CACHE_FILE, load_cache
from llmtrain.stages.spec import ImplicitReward

KTO_FORMATS = ("unpaired", "preference")


@dataclass
class KTOConfig:
    """stage=kto: TRL's KTO on unpaired completions against a frozen reference."""
    beta: float = 0.1
    loss_type: str = "kto"  # kto | apo_zero_unpaired (losses/kto.KTO_LOSSES)
    desirable_weight: float = 1.0  # λ_D: weight of a desirable completion's loss
    undesirable_weight: float = 1.0  # λ_U (the paper: keep λ_D·n_D / (λ_U·n_U) in [1, 4/3])
    # the reference's log-probs computed once before training into <output_dir>/ref_logps.pt, the reference released
    precompute_ref_logps: bool = False


@dataclass
class KTOBatch(PairBatch):
    """A PairBatch of N completions (the "chosen" half) and their N KL sequences (the "rejected" half)."""
    desirable: torch.Tensor | None = None  # (N,) bool
    pair: torch.Tensor | None = None  # (N,) long: the held-out pair a row came from, -1 for none
    reference: torch.Tensor | None = None  # (2N,) fp32: the reference's log-probs, set in the step before the update

    def to(self, device, non_blocking: bool = False) -> KTOBatch:
        moved = super().to(device, non_blocking)
        return replace(moved, desirable=self.desirable.to(device), pair=self.pair.to(device))


def collate_kto(examples: list[dict], pad_token_id: int, padding_free: bool = False, keyed: bool = False) -> KTOBatch:
    """Unpaired examples (data/unpaired_format.UNPAIRED_COLUMNS) -> a KTOBatch; `keyed`: with each row's key into the
    precomputed reference log-probs (its completion and KL sequence)."""
    sides = [{"chosen_input_ids": e["input_ids"], "chosen_labels": e["labels"], "rejected_input_ids": e["kl_input_ids"],
              "rejected_labels": e["kl_labels"], **{k: v for k, v in e.items() if k.startswith("__")}}
             for e in examples]
    batch = collate_pairs(sides, pad_token_id=pad_token_id, padding_free=padding_free, keyed=keyed)
    return KTOBatch(**vars(batch), desirable=torch.tensor([bool(e["desirable"]) for e in examples]),
                    pair=torch.tensor([int(e["pair"]) for e in examples]))


class KTOStage(DPOStage):
    """DPO's reference handling (roles, the precomputed table, `prepare`, `reference_logps`) with KTO's step."""
    name = "kto"
    count_name = "completions"

    def __init__(self, source: ModelSource, pad_token_id: int, *, beta: float, loss_type: str,
                 desirable_weight: float, undesirable_weight: float, padding_free: bool = False,
                 cache_path: Path | None = None, resumed_run: Path | None = None, eval_batch_size: int = 1,
                 pipelined: bool = False):
        self.beta, self.loss_type = beta, loss_type
        self.weights = {"desirable_weight": desirable_weight, "undesirable_weight": undesirable_weight}
        # backend.pp > 1: the reference log-probs are the policy's own before step 1 (DPO's `initial_policy_logps`)
        self.average, self.pipelined = False, pipelined
        self.cache_path, self.eval_batch_size = cache_path, eval_batch_size
        self.cache_meta = {"reference": repr(source), "stage": "kto", "field": "kto.precompute_ref_logps"}
        places = [] if cache_path is None else [cache_path, *([resumed_run / CACHE_FILE] if resumed_run else [])]
        self.cache = next(filter(None, (load_cache(place, self.cache_meta) for place in places)), None)
        self.roles = dpo_roles(None, source)
        if self.cache is not None or pipelined:
            del self.roles["reference"]
        self.collate = partial(collate_kto, pad_token_id=pad_token_id, padding_free=padding_free,
                               keyed=cache_path is not None)

    def terms(self, policy_logps, reference_logps, desirable, kl):
        return kto_loss_terms(policy_logps, reference_logps, desirable, kl, beta=self.beta, loss_type=self.loss_type,
                              **self.weights)

    @torch.no_grad()
    def forward_logps(self, engine, batch: KTOBatch) -> torch.Tensor:
        """(2N,) fp32 log-probs of the completions then the KL sequences, no grad; a pipelined engine computes them
        on its last stage and hands them to every pp rank."""
        if self.pipelined:
            return engine.evaluate_sums([batch], lambda module, rows: torch.cat(self.logps(module, rows)),
                                        batch.num_sequences).float()
        with engine.autocast():
            return torch.cat(self.logps(engine.module, batch))

    @torch.no_grad()
    def reference_point(self, policy, batches: list[KTOBatch]) -> torch.Tensor:
        """z0 of the global batch (0-d fp32, detached): the policy's KL-half forward (no grad) against the reference's
        log-probs each batch carries, summed over every micro-batch and rank."""
        if self.loss_type not in USES_KL:
            return torch.zeros((), device=batches[0].desirable.device)
        kl_sum = count = 0.0
        for batch in batches:
            policy_kl = batch.split(self.forward_logps(policy, batch))[1]  # (N,)
            kl_sum = kl_sum + mismatched_kl_sum(policy_kl, batch.split(batch.reference)[1], batch.counted)
            count = count + batch.counted.double().sum()
        kl_sum, count = reduce_sums([kl_sum, count], policy)
        return kl_reference_point(kl_sum, count).to(batches[0].desirable.device)

    def train_step(self, micro_batches: list[KTOBatch], engines: dict, updater: Updater) -> dict:
        policy, reference = engines["policy"], engines.get("reference")
        # The reference first: with LoRA it is the policy's own model (adapters off)
        batches = [replace(b, reference=torch.cat(self.reference_logps(reference, b))) for b in micro_batches]
        kl = self.reference_point(policy, batches)

        def micro_loss(module, batch: KTOBatch):
            (logps, _), term, router_stats = self.logps(module, batch, route=True)  # (N,) completions' log-probs
            terms = self.terms(logps, batch.split(batch.reference)[0], batch.desirable, kl)
            counted = batch.counted  # (N,) 1; under sp 0 on the peers of rank 0 (stages/pair_shard.py)
            return with_router((terms.losses * counted).sum(), kto_stat_sums(terms, logps, batch.desirable, counted),
                               term, router_stats)

        rows = sum(b.num_pairs for b in batches)
        result, routed = routed_update(updater, policy, batches, micro_loss, rows, len(KTO_STATS))
        return {"loss": result.loss, **kto_metrics(dict(zip(KTO_STATS, result.sums))), "kl": kl.item(),
                "lr": result.lr, "grad_norm": result.grad_norm, "completions": result.count, **routed}

    @torch.no_grad()
    def evaluate(self, batches, engines: dict) -> dict:
        policy, reference = engines["policy"], engines.get("reference")
        policy.module.eval()
        rows = []  # (pair, desirable, log-ratio, KL-sequence log-ratio) of every real held-out row of this rank
        for batch in batches:
            logps = self.forward_logps(policy, batch)  # (2N,)
            ratios = batch.split(logps - torch.cat(self.reference_logps(reference, batch)))  # (N,) each
            kept = batch.counted > 0
            rows += zip(batch.pair[kept].tolist(), batch.desirable[kept].tolist(), ratios[0][kept].tolist(),
                        ratios[1][kept].tolist())
        return self.eval_metrics(gather_rows(rows, policy.dp_group))

    def eval_metrics(self, rows: list[tuple]) -> dict:
        """Every held-out row (the same list on every rank) -> the eval record."""
        pair, desirable, ratio, kl_ratio = (torch.tensor(column, dtype=torch.float64) for column in zip(*rows))
        kl = kl_reference_point(kl_ratio.sum(), len(rows)) if self.loss_type in USES_KL else torch.zeros(())
        terms = self.terms(ratio, torch.zeros_like(ratio), desirable.bool(), kl)
        rewards = {(int(p), bool(d)): r for p, d, r in zip(pair.tolist(), desirable.tolist(), terms.rewards.tolist())
                   if p >= 0}
        margins = [rewards[(p, True)] - rewards[(p, False)] for p, d in rewards if d and (p, False) in rewards]
        record = {"eval_loss": terms.losses.double().mean().item(), "eval_kl": kl.item(), "eval_completions": len(rows)}
        if margins:
            record.update(eval_reward_accuracy=sum(m > 0 for m in margins) / len(margins),
                          eval_reward_margin=sum(margins) / len(margins), eval_pairs=len(margins))
        return record


def gather_rows(rows: list, group) -> list:
    """Every rank's rows, in rank order, on every rank of `group`."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return list(rows)
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(rows), group=group)
    return [row for part in gathered for row in part]


def build(cfg, source: ModelSource, tokenizer, attn_implementation: str) -> KTOStage:
    k, t = cfg.kto, cfg.trainer
    return KTOStage(source, tokenizer.pad_token_id, beta=k.beta, loss_type=k.loss_type,
                    desirable_weight=k.desirable_weight, undesirable_weight=k.undesirable_weight,
                    padding_free=padding_free_for(attn_implementation),
                    cache_path=Path(cfg.output_dir) / CACHE_FILE if k.precompute_ref_logps else None,
                    resumed_run=resumed_run_dir(cfg.resume), eval_batch_size=t.eval_batch_size or t.micro_batch_size,
                    pipelined=degree_of(cfg.backend, "pp") > 1)


def problems(cfg, dp: int) -> list[str]:
    k, found = cfg.kto, pair_problems(cfg, "kto")
    if k.loss_type not in KTO_LOSSES:
        found.append(f"kto.loss_type={k.loss_type!r} is not one of {', '.join(KTO_LOSSES)}")
    if not k.beta > 0:
        found.append(f"kto.beta={k.beta} must be > 0 (typical: 0.1; it scales the implied reward)")
    for name in ("desirable_weight", "undesirable_weight"):
        if not k[name] > 0:
            found.append(f"kto.{name}={k[name]} must be > 0 (typical: 1; balance λ_D·n_D against λ_U·n_U)")
    pp = degree_of(cfg.backend, "pp")
    if pp > 1 and not k.precompute_ref_logps:
        found.append(f"stage=kto with backend.pp={pp} computes the reference log-probs once, before step 1, through "
                     "the policy's own pipeline (as DPO): set kto.precompute_ref_logps=true, or backend.pp=1")
    return found


STAGE_SPECS = (pair_spec(name="kto", build=build, roles=dpo_roles, metric_group="kto", config_node="kto",
                         config_class=KTOConfig, problems=problems, data_formats=KTO_FORMATS, unpaired=True,
                         count_name="completions", sequence_parallel=True, pair_scores="implicit",
                         implicit_reward=lambda cfg: ImplicitReward(beta=cfg.kto.beta, averaged=False, reference=True),
                         data_hint="trains on completions marked desirable or undesirable: data.format={format} "
                                   "must be unpaired (prompt, completion, label) or preference (each pair one "
                                   "desirable and one undesirable completion)"),)
