"""DPO: a trainable policy against a frozen reference, on pairs of responses to the same prompt.

Roles: "policy" (trainable) and "reference" (frozen, built from the same source: the initial policy; with
peft=lora the policy itself with its adapters disabled, no second copy of the base).
The reference's log-probs are computed in the same step from its frozen engine (same precision, no
dropout), or once before training with dpo.precompute_ref_logps (stages/reference_cache.py). Loss of a
step: Σ_pairs ℓ(β·((π_c − ref_c) − (π_r − ref_r))) / pairs in the global batch, ℓ from `dpo.loss` (sigmoid,
with optional label smoothing = cDPO; ipo on length-averaged log-probs, as TRL). At step 0 the policy equals the
reference: the loss is ln 2, the rewards are 0.

Under backend.pp > 1 the reference log-probs are computed once, before step 1, by a forward-only pass through the
POLICY's own pipeline stages (`initial_policy_logps`), and kept as dpo.precompute_ref_logps keeps them. Why not a
frozen pipelined reference role: the policy before its first update is the reference (same source; `prepare` runs
before a resumed run loads its checkpoint, so it holds the initial weights then too), so this needs no second set of
stages, no second copy of the weights and no reference forward in every step; a frozen role would need its own stage
buffers and schedule, and its last stage would have to hand log-probs to the policy's last stage, on another rank
whenever the two splits differ. So under pp dpo.precompute_ref_logps=false (the in-step reference) is refused with
that fix, and no reference role is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from llmtrain.data.pipeline import eval_batches
from llmtrain.losses.dpo import (
    AVERAGED_LOGPS,
    DPO_LOSSES,
    DPO_STATS,
    SMOOTHED_LOSSES,
    dpo_loss_terms,
    dpo_metrics,
    dpo_stat_sums,
)
from llmtrain.parallel import degree_of
from llmtrain.stages.base import ModelSource, RoleSpec, Stage, Updater, eval_totals
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
from llmtrain.stages.reference_cache import CACHE_FILE, compute_cache, load_cache
from llmtrain.stages.spec import ImplicitReward


@dataclass
class DPOConfig:
    """stage=dpo: policy vs a frozen reference on the summed response log-probs of each pair."""
    beta: float = 0.1
    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge | robust | bco_pair | sppo_hard | nca_pair | apo_zero
    # | apo_down (losses/dpo.DPO_LOSSES, TRL's loss types)
    label_smoothing: float = 0.0  # > 0: conservative DPO (cDPO), the labels flipped with this probability
    # the reference's log-probs computed once before training into <output_dir>/ref_logps.pt, the reference released
    precompute_ref_logps: bool = False


class DPOStage(Stage):
    name = "dpo"
    count_name = "pairs"

    def __init__(self, source: ModelSource, pad_token_id: int, *, beta: float, loss: str, label_smoothing: float,
                 padding_free: bool = False, cache_path: Path | None = None, resumed_run: Path | None = None,
                 eval_batch_size: int = 1, pipelined: bool = False):
        self.beta, self.loss, self.label_smoothing = beta, loss, label_smoothing
        self.average = loss in AVERAGED_LOGPS
        # dpo.precompute_ref_logps: the table's file in this run (None: off); a resumed run finds it there or beside
        # the run it resumes, and builds no reference
        self.cache_path, self.eval_batch_size = cache_path, eval_batch_size
        self.cache_meta = {"reference": repr(source), "averaged": self.average}
        places = [] if cache_path is None else [cache_path, *([resumed_run / CACHE_FILE] if resumed_run else [])]
        self.cache = next(filter(None, (load_cache(place, self.cache_meta) for place in places)), None)
        self.roles = dpo_roles(None, source)
        self.pipelined = pipelined  # backend.pp > 1: the reference log-probs come from the policy's own stages
        if self.cache is not None or pipelined:
            del self.roles["reference"]
        self.collate = partial(collate_pairs, pad_token_id=pad_token_id, padding_free=padding_free,
                               keyed=cache_path is not None)

    def prepare(self, engines: dict, data, prepare_batch) -> dict:
        if self.cache_path is None:
            return engines
        if self.cache is not None:  # read beside the run this one resumes: kept in this run's folder too
            if engines["policy"].ctx.is_main and not self.cache_path.is_file():
                self.cache.save(self.cache_path)
            return engines
        reference = engines["policy" if self.pipelined else "reference"]
        batches = (prepare_batch(batch) for examples in (data.train, data.eval) if examples is not None
                   for batch in eval_batches(examples, batch_size=self.eval_batch_size, dp_rank=reference.dp_rank,
                                             dp_size=reference.dp_size, collate_fn=self.collate)())
        logps = self.initial_policy_logps if self.pipelined else self.reference_logps
        self.cache = compute_cache(partial(logps, reference), batches, self.cache_meta, self.cache_path,
                                   reference.ctx.is_main)
        self.roles.pop("reference", None)
        return {role: engine for role, engine in engines.items() if role != "reference"}

    def logps(self, module, batch: PairBatch, route: bool = False):
        """(chosen (P,), rejected (P,)) response log-probs (summed, or averaged for ipo), fp32; with `route` also the
        MoE routers' term and statistics."""
        sums, term, stats = pair_logps(module, batch, self.average, route)
        return (batch.split(sums), term, stats) if route else batch.split(sums)

    @torch.no_grad()
    def reference_logps(self, reference, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen (P,), rejected (P,)): the frozen reference's forward, or the precomputed table."""
        if self.cache is not None:
            return self.cache.lookup(batch.keys, batch.weight)
        with reference.autocast():
            return self.logps(reference.module, batch)

    @torch.no_grad()
    def initial_policy_logps(self, policy, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen (P,), rejected (P,)): the pipelined policy's forward before its first update (the reference's
        log-probs: module docstring), computed on its last stage and summed over the pp ranks (the others add 0)."""
        both = policy.evaluate_sums([batch], lambda module, rows: torch.cat(self.logps(module, rows)),
                                    batch.num_sequences)  # (2P,) fp64, exactly the fp32 values
        return batch.split(both.float())

    def terms(self, policy_logps, reference_logps):
        return dpo_loss_terms(*policy_logps, *reference_logps, beta=self.beta, loss_type=self.loss,
                              label_smoothing=self.label_smoothing)

    def train_step(self, micro_batches: list[PairBatch], engines: dict, updater: Updater) -> dict:
        reference = engines.get("reference")

        def micro_loss(module, batch: PairBatch):
            # The reference first: with LoRA it is the policy's own model (adapters off), so its no-grad forward
            # does not fall between the policy's forward and backward.
            reference_logps = self.reference_logps(reference, batch)
            policy, aux_term, router_stats = self.logps(module, batch, route=True)  # MoE: + coef × router aux loss
            terms = self.terms(policy, reference_logps)
            share = batch.share  # under sp each pair counts on one peer (stages/pair_shard.py); 1 without
            return with_router(terms.losses.sum() * share, dpo_stat_sums(terms, *policy) * share, aux_term,
                               router_stats)

        pairs = sum(b.num_pairs for b in micro_batches)
        result, routed = routed_update(updater, engines["policy"], micro_batches, micro_loss, pairs, len(DPO_STATS))
        metrics = dpo_metrics(dict(zip(DPO_STATS, result.sums)), max(result.count, 1))
        return {"loss": result.loss, **metrics, "lr": result.lr, "grad_norm": result.grad_norm, "pairs": result.count,
                **routed}

    @torch.no_grad()
    def evaluate(self, batches, engines: dict) -> dict:
        policy, reference = engines["policy"], engines.get("reference")
        policy.module.eval()

        def batch_sums(module, batch: PairBatch) -> torch.Tensor:  # (4,) loss, correct, margin, pairs
            return reward_eval_sums(self.terms(self.logps(module, batch), self.reference_logps(reference, batch)),
                                    batch)

        return reward_eval_metrics(eval_totals(policy, batches, batch_sums, 4))


def dpo_roles(cfg, source: ModelSource) -> dict[str, RoleSpec]:
    """The policy and its frozen reference; under backend.pp > 1 the policy alone (module docstring)."""
    roles = {"policy": RoleSpec(source, head="lm", trainable=True)}
    if cfg is None or degree_of(cfg.backend, "pp") == 1:
        roles["reference"] = RoleSpec(source, head="lm", trainable=False, adapter_off_of="policy")
    return roles


def build(cfg, source: ModelSource, tokenizer, attn_implementation: str) -> DPOStage:
    d = cfg.dpo
    t = cfg.trainer
    return DPOStage(source, tokenizer.pad_token_id, beta=d.beta, loss=d.loss, label_smoothing=d.label_smoothing,
                    padding_free=padding_free_for(attn_implementation),
                    cache_path=Path(cfg.output_dir) / CACHE_FILE if d.precompute_ref_logps else None,
                    resumed_run=resumed_run_dir(cfg.resume), eval_batch_size=t.eval_batch_size or t.micro_batch_size,
                    pipelined=degree_of(cfg.backend, "pp") > 1)


def resumed_run_dir(resume: str | None) -> Path | None:
    """The run folder `resume=PATH` names (a run folder or one of its checkpoints/step_N); None for auto or none."""
    if resume in (None, "auto"):
        return None
    path = Path(resume)
    return path if (path / "checkpoints").is_dir() else path.parent.parent


def problems(cfg, dp: int) -> list[str]:
    d, found = cfg.dpo, pair_problems(cfg, "dpo")
    if d.loss not in DPO_LOSSES:
        found.append(f"dpo.loss={d.loss!r} is not one of {', '.join(DPO_LOSSES)}")
    if not d.beta > 0:
        found.append(f"dpo.beta={d.beta} must be > 0 (typical: 0.1; it scales the implicit reward)")
    if not 0 <= d.label_smoothing < 0.5:
        found.append(f"dpo.label_smoothing={d.label_smoothing} must be in [0, 0.5)")
    pp = degree_of(cfg.backend, "pp")
    if pp > 1 and not d.precompute_ref_logps:
        found.append(f"stage=dpo with backend.pp={pp} computes the reference log-probs once, before step "
                     "1, through the policy's own pipeline (no frozen pipelined reference role is built): set "
                     "dpo.precompute_ref_logps=true, or backend.pp=1 for the in-step reference")
    if d.loss in DPO_LOSSES and d.loss not in SMOOTHED_LOSSES and d.label_smoothing > 0:
        found.append(f"dpo.label_smoothing applies to dpo.loss={' or '.join(sorted(SMOOTHED_LOSSES))} only: set it to "
                     f"0 with {d.loss}")
    return found


def implicit_reward(cfg) -> ImplicitReward:
    return ImplicitReward(beta=cfg.dpo.beta, averaged=cfg.dpo.loss in AVERAGED_LOGPS, reference=True)


STAGE_SPECS = (pair_spec(name="dpo", build=build, roles=dpo_roles, metric_group="dpo", config_node="dpo",
                         config_class=DPOConfig, problems=problems, pair_scores="implicit",
                         implicit_reward=implicit_reward, sequence_parallel=True),)
