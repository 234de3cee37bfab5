"""A run that cannot fit stops before it loads: the plan's row for the run's backend against the memory it must fit
(a GPU's own memory per rank; on a CPU the host's RAM, shared by its local ranks), and the fixes that would make it
fit, each planned the same way. `plan.enforce_fit=false` runs anyway; `dry_run=true` only prints the plan."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace

from omegaconf import DictConfig

from llmtrain.metrics.cost import GIB, Layout
from llmtrain.metrics.devices import Gpu, host_memory_gib
from llmtrain.models.facts import lora_trainable
from llmtrain.parallel import row_degrees
from llmtrain.plan.core import USABLE, Row, compared_layouts, largest_micro_batch, plan_row
from llmtrain.plan.figures import RunPlan
from llmtrain.plan.report import _size
from llmtrain.plan.setting import Setting
from llmtrain.stages.registry import stage_roles


@dataclass(frozen=True)
class Budget:
    """The memory a run's plan must fit, USABLE of it. A GPU: its own memory, one rank each, so a rank's total must
    fit it. A CPU: the host's RAM, which every rank of the host shares, so the rule is ranks × a rank's total ≤
    RAM × USABLE; there what offload puts "in host memory" is in the same RAM and counts too."""
    device: str  # the plan's device name ("cpu": the host's RAM)
    memory_gib: float  # one GPU's memory, or the host's RAM
    ranks: int = 1  # ranks drawing on it: 1 on a GPU, the host's local ranks on a CPU

    @property
    def per_rank(self) -> float:
        """Usable bytes per rank."""
        return self.memory_gib * GIB * USABLE / self.ranks

    def held(self, row: Row) -> float:
        """Bytes one rank holds in this memory: the row's device total (+ its host offload on a CPU)."""
        return row.device_bytes + (sum(s.host for s in row.states.values()) if self.device == "cpu" else 0.0)

    def fits(self, row: Row) -> bool:
        return self.held(row) <= self.per_rank

    def largest_micro(self, row: Row, micro: int) -> int:
        """The largest micro-batch that fits (0: not even 1): activations and logits grow with it, the states not."""
        per_one = (row.activations + row.logits) / micro
        return largest_micro_batch(self.held(row) - per_one * micro, lambda b: b * per_one, self.per_rank)


def local_ranks() -> int:
    """This host's ranks: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, else 1 (no launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


def fit_budget(gpu: Gpu, ranks_on_host: int = 1, host_gib: float | None = None) -> Budget:
    """A GPU: the plan's device memory (plan.memory_gb, the table's, or the device's own), one rank. A CPU: the host's
    RAM (`host_gib`, else os.sysconf's physical pages, as the plan's table reads them) over `ranks_on_host`."""
    if gpu.name != "cpu":
        return Budget(gpu.name, gpu.memory_gib)
    return Budget("cpu", host_gib if host_gib is not None else host_memory_gib(), max(1, ranks_on_host))


def fit_problems(row: Row, budget: Budget, micro: int, fixes: Sequence[str] = (), subject: str = "") -> list[str]:
    """[] when the plan's row fits the budget; else the lines a run stops with: GiB needed against usable, the
    micro-batch and the largest that fits, the `fixes` (fit_fixes), and the override that runs anyway."""
    if budget.fits(row):
        return []
    need, largest = budget.held(row), budget.largest_micro(row, micro)
    states = need - row.activations - row.logits
    parts = (f"model states {_size(states)}, activations {_size(row.activations)}, logits {_size(row.logits)}")
    usable = f"{_size(budget.per_rank * budget.ranks)} GiB usable ({USABLE:.0%} of {budget.memory_gib:.1f} GiB)"
    where = (f"one {budget.device} per rank has {usable}" if budget.device != "cpu" else
             f"on cpu the host's RAM is shared by its {budget.ranks} rank{'s' if budget.ranks > 1 else ''} "
             f"(LOCAL_WORLD_SIZE): {budget.ranks} × "
             f"{_size(need)} = {_size(need * budget.ranks)} GiB needed, {usable}")
    lines = [f"the plan does not fit: {subject + ', ' if subject else ''}backend {row.layout.name} needs "
             f"{_size(need)} GiB per rank at trainer.micro_batch_size={micro} ({parts}); {where}; "
             + (f"the largest micro-batch that fits is {largest}" if largest else
                f"even micro-batch 1 does not fit (the model states alone need {_size(states)} GiB per rank)")]
    lines += ["fixes (GiB per rank, planned the same way):", *(f"  - {fix}" for fix in fixes)] if fixes else [
        "no override of this run lowers it: more memory per rank or a smaller model"]
    lines.append("stopped before loading anything; plan.enforce_fit=false runs it anyway (dry_run=true prints the "
                 "plan)")
    return lines


def _lora_setting(cfg: DictConfig, st: Setting) -> Setting | None:
    """This run's setting under the shipped peft=lora (conf/peft/lora.yaml); None where the backend refuses LoRA."""
    from omegaconf import OmegaConf

    from llmtrain.models.lora_checks import peft_problems
    from llmtrain.paths import conf_dir

    peft = OmegaConf.load(conf_dir() / "peft" / "lora.yaml")
    if peft_problems(peft, cfg.backend):
        return None
    lora = lora_trainable(SimpleNamespace(peft=peft, model=cfg.model))
    views = frozenset(role for role, r in stage_roles(cfg).items() if r.adapter_off_of)
    return replace(st, lora=lora, views=views)


def fit_fixes(cfg: DictConfig, st: Setting, row: Row, budget: Budget) -> list[str]:
    """The overrides that lower this run's per-rank total, each with the total it gives (planned, no weights): a
    smaller micro-batch when one fits; activation checkpointing when off; peft=lora when the model trains whole;
    each compared backend preset that holds less here, lowest first (ZeRO-3 / FSDP2 shard over dp > 1, offload frees
    a GPU, not a CPU's RAM); each named when it fits or takes a tenth of the total off. If none fits alone,
    every one that lowers the total, together (with the backend that holds least)."""
    need, per_rank = budget.held(row), budget.per_rank
    largest = budget.largest_micro(row, st.micro)
    out = [f"trainer.micro_batch_size={largest}: the largest that fits (raise trainer.grad_accum_steps to keep the "
           "global batch)"] if largest else []
    candidates: dict[str, tuple[Setting, Layout]] = {}
    if not st.checkpointing:
        candidates["model.activation_checkpointing=true"] = (replace(st, checkpointing=True), row.layout)
    lora = _lora_setting(cfg, st) if cfg.peft.name == "none" else None
    if lora is not None:
        candidates["peft=lora"] = (lora, row.layout)
    presets = compared_layouts(cfg, st.world, st.facts, row_degrees(cfg.backend))[0]  # at the run's sp and cp
    backends = {f"backend={lay.name}": (st, lay) for lay in presets if lay.name != row.layout.name}
    totals = {k: (s, lay, budget.held(plan_row(s, lay))) for k, (s, lay) in {**candidates, **backends}.items()}
    lower = {k: v for k, v in totals.items() if v[2] < need and k not in backends}
    lower |= dict(sorted(((k, v) for k, v in totals.items() if v[2] < need and k in backends),
                         key=lambda kv: kv[1][2]))  # the backend that holds least first
    # named alone: a fix that fits, or takes a tenth of the total off (not a few GiB off hundreds)
    out += [f"{k}: {_size(total)} ({'fits' if total <= per_rank else 'still too much'})"
            for k, (_, _, total) in lower.items() if total <= per_rank or total <= 0.9 * need]
    if len(lower) > 1 and all(total > per_rank for _, _, total in lower.values()):
        together = replace(st, checkpointing=st.checkpointing or "model.activation_checkpointing=true" in lower)
        if "peft=lora" in lower:  # LoRA has no tensor-parallel plan (models/lora_checks.py)
            together = replace(together, lora=lora.lora, views=lora.views)
        layouts = [row.layout, *(lay for k, (_, lay, _) in lower.items()
                                 if k in backends and (lay.tp == 1 or "peft=lora" not in lower))]
        layout = min(layouts, key=lambda lay: budget.held(plan_row(together, lay)))
        best = plan_row(together, layout)
        fits_at = budget.largest_micro(best, st.micro)
        keys = " ".join(k for k in lower if k not in backends or k == f"backend={layout.name}")
        out.append(f"{keys} together: {_size(budget.held(best))} at micro-batch {st.micro} " + (
            "(fits)" if fits_at >= st.micro else f"(fits at trainer.micro_batch_size={fits_at})" if fits_at else
            "(still too much, even at micro-batch 1: more memory per rank, e.g. more GPUs under ZeRO-3 or FSDP2, "
            "or a smaller model)"))
    return out


def run_fit_problems(cfg: DictConfig, plan: RunPlan) -> list[str]:
    """The run's fit check (run.py: on every rank, before the process group starts and any weights load): [] when
    the plan fits or plan.enforce_fit=false; else fit_problems' lines, with the fixes planned for this run."""
    budget = run_budget(cfg, plan.gpu)
    if not cfg.plan.enforce_fit or budget.fits(plan.row):
        return []
    st = plan.setting
    subject = (f"model {st.facts.label} ({st.facts.params / 1e9:.2f}B parameters{', LoRA' if st.lora else ''}), "
               f"precision {st.precision}, world {st.world}")
    return fit_problems(plan.row, budget, st.micro, fit_fixes(cfg, st, plan.row, budget), subject)


def run_budget(cfg: DictConfig, gpu: Gpu) -> Budget:
    ranks = local_ranks()  # plan.memory_gb is per rank (resolve_gpu): on a CPU host its ranks share ranks × that
    return fit_budget(gpu, ranks, None if cfg.plan.memory_gb is None else cfg.plan.memory_gb * ranks)
