"""Tensor-parallel plans: transformers' `base_model_tp_plan`, turned into torch ParallelStyles.

A plan maps module paths under the base model (`layers.*.self_attn.q_proj`) to a style name. We map
only the two Megatron styles: "colwise" (q/k/v, gate/up: output features split, bias split with them)
and "rowwise" (o_proj, down_proj: input features split, partial sums all-reduced to a replicated
output). Each attention block thus holds `heads / tp` query heads and `kv_heads / tp` kv-heads on
every rank; transformers' attention reshapes with `view(..., -1, head_dim)`, so it runs on the local
heads without knowing, while `config.num_attention_heads` stays the global count (what is saved and
exported). Column chunks are contiguous, so rank r holds query heads [r·H/tp, (r+1)·H/tp) and exactly
the kv-heads those query heads use under GQA (head i reads kv-head i // (H/KV)).

Collectives: each sub-block that holds colwise projections (`layers.*.self_attn`, `layers.*.mlp`: the
parents of the colwise paths) receives its input as a Replicate DTensor. Its colwise projections then
add their input gradients as one Partial DTensor, all-reduced once where the input entered, as Megatron
does: per block one forward all-reduce per rowwise projection and one backward all-reduce per sub-block
(4), not one per colwise projection as well (7 with q, k, v, gate, up reducing their own).

Not sharded, stated here once: the token embedding, the final norm and the LM head stay replicated
across the tp group (FSDP still shards them over dp), so every tp rank computes the full logits
(B, T, V) and the same loss; no loss-parallel. That costs V·h of memory per tp rank and duplicated
LM-head FLOPs, which is the price of using transformers' plans unchanged.

The other styles transformers' plans name, mapped here (each with a 2-rank parity row in
tests/dist/test_families.py):
- "replicated_with_grad_allreduce" (Qwen3's and Gemma-3's per-head q_norm/k_norm, between a colwise and a
  rowwise projection): the weight a Replicate DTensor, the input this rank's heads as Shard(heads); the weight's
  gradient comes out Partial (each rank saw its own heads) and FSDP2 reduces it to Replicate over tp.
- "colwise_gather_output" / "rowwise_split_input" (Phi-3's fused qkv_proj and gate_up_proj, whose outputs
  interleave q, k, v or gate, up): column-sharded weights whose output is all-gathered, so attention and the
  activation run on whole tensors (every tp rank computes them: the weights are split, the attention FLOPs are
  not), then a row-sharded projection that splits its replicated input locally.
- "moe_tp_experts" (Mixtral's, Qwen3-MoE's experts module; its "packed_colwise"/"rowwise" parameter entries
  are subsumed; from transformers 5.25 on the tp plans leave the experts out and `base_model_ep_plan` names them
  "ep_dispatch_experts", which tp_plan maps to this style): the experts are split over the tp ranks along the
  expert dim (E/tp whole experts each, as transformers' expert parallelism with `ep_implementation="all_reduce"`
  over a shared batch does); each rank runs its experts on the tokens routed to them and the partial outputs are
  summed (one all-reduce forward; one on the input's and the routing weights' gradients backward).

Families transformers ships no plan for (GPT-2: fused c_attn, Conv1D) are refused before the model
loads; add a plan to EXTRA_TP_PLANS (keyed by model_type) only together with a parity test.
"""

from __future__ import annotations

import logging
from collections import Counter
from fnmatch import fnmatch
from functools import partial
from typing import Any

import torch

from llmtrain.models.backbone import backbone

log = logging.getLogger(__name__)

EXTRA_TP_PLANS: dict[str, dict[str, str]] = {}  # model_type -> {module path pattern: style}
SUPPORTED_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "colwise_gather_output",
                    "rowwise_split_input", "moe_tp_experts")
EXPERTS_STYLE = "moe_tp_experts"
EP_EXPERTS_STYLE = "ep_dispatch_experts"
WORKING_BACKENDS = "backend=fsdp2 (backend.tp=1), backend=ddp or backend=deepspeed"


def tp_plan(arch: Any) -> dict[str, str] | None:
    """The plan for this architecture config (None: it has none), with its experts modules in the experts style."""
    plan = EXTRA_TP_PLANS.get(arch.model_type) or getattr(arch, "base_model_tp_plan", None) or None
    if plan is None or EXPERTS_STYLE in plan.values():
        return plan
    return {**plan, **experts_from_ep_plan(arch)}


def experts_from_ep_plan(arch: Any) -> dict[str, str]:
    """transformers >= 5.25 names MoE experts modules in `base_model_ep_plan` ("ep_dispatch_experts") instead of the
    tp plan; those modules are the ones the experts style splits over tp (as `ep_implementation="all_reduce"`)."""
    ep_plan = getattr(arch, "base_model_ep_plan", None) or {}
    return {path: EXPERTS_STYLE for path, style in ep_plan.items() if style == EP_EXPERTS_STYLE}


def tp_plan_problems(arch: Any, tp: int) -> list[str]:
    """Why this architecture cannot run at this tp degree (empty: it can). Reads the config only."""
    if tp == 1:
        return []
    plan = tp_plan(arch)
    if plan is None:
        return [f"backend.tp={tp}: model_type {arch.model_type!r} ({type(arch).__name__}) has no "
                f"tensor-parallel plan (transformers' base_model_tp_plan is empty), so its weights cannot "
                f"be sharded correctly; use {WORKING_BACKENDS}"]
    unknown = sorted({style for style in module_plan(plan).values() if style not in SUPPORTED_STYLES})
    if unknown:
        return [f"backend.tp={tp}: model_type {arch.model_type!r}'s tensor-parallel plan uses style(s) "
                f"{', '.join(unknown)}, which llmtrain does not map (only {', '.join(SUPPORTED_STYLES)}); "
                f"use {WORKING_BACKENDS}"]
    from llmtrain.models.moe import expert_count

    experts = expert_count(arch)
    if EXPERTS_STYLE not in plan.values():
        return []
    if experts and experts % tp:
        return [f"backend.tp={tp} must divide the model's {experts} experts ({arch.model_type}: each tp rank holds "
                f"experts/tp whole experts); pick a tp that divides {experts}, or {WORKING_BACKENDS}"]
    return [f"backend.tp={tp}: {arch.model_type}'s experts module {name} is not called the way transformers' routed "
            f"experts are (hidden_states, top_k_index, top_k_weights), so llmtrain cannot split its experts over tp; "
            f"use {WORKING_BACKENDS}" for name in sorted(unroutable_experts(arch, plan))]


def unroutable_experts(arch: Any, plan: dict[str, str]) -> set[str]:
    """The classes of the experts modules the plan splits that ExpertsOverTP cannot wrap, from the model built on
    the meta device (no storage; a config transformers cannot build is left to the load's own error)."""
    from transformers import AutoModelForCausalLM

    from llmtrain.models.tp_styles import routed_experts

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(arch)
    except Exception:  # noqa: BLE001 - e.g. remote code: the load reports it, and ExpertsOverTP refuses at apply
        return set()
    paths = [path for path, style in plan.items() if style == EXPERTS_STYLE]
    return {type(module).__name__ for name, module in backbone(model).named_modules()
            if any(fnmatch(name, path) for path in paths) and not routed_experts(module)}


def module_plan(plan: dict[str, str]) -> dict[str, str]:
    """The plan's module entries: the parameter entries under an experts module (its packed gate_up_proj and
    down_proj) are the experts style's to shard."""
    experts = [path for path, style in plan.items() if style == EXPERTS_STYLE]
    return {path: style for path, style in plan.items()
            if not any(path.startswith(parent + ".") for parent in experts)}


def parallel_styles(plan: dict[str, str], tp_mesh) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from llmtrain.models.tp_styles import ExpertsOverTP, HeadShardedNorm

    # use_local_output (default): activations between the Linear layers stay plain local tensors, so
    # attention, rotary embeddings and the MLP activation run unchanged on the local heads/columns.
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": partial(ColwiseParallel, output_layouts=Replicate()),
              "rowwise_split_input": partial(RowwiseParallel, input_layouts=Replicate()),
              "replicated_with_grad_allreduce": HeadShardedNorm, EXPERTS_STYLE: ExpertsOverTP}
    return {path: styles[style]() for path, style in module_plan(plan).items()}


def colwise_parents(plan: dict[str, str]) -> dict[str, str]:
    """The sub-blocks whose input the colwise projections read, with one such projection's name:
    {`layers.*.self_attn`: "q_proj", `layers.*.mlp`: "gate_proj"}."""
    return {path.rsplit(".", 1)[0]: path.rsplit(".", 1)[1] for path, style in plan.items() if style == "colwise"}


def _replicate_input(tp_mesh, module, args, kwargs):
    """Forward pre-hook: the sub-block's input (first argument, or `hidden_states=`) as a Replicate DTensor;
    the colwise projections take it as it is, and its gradient is all-reduced once, here."""
    from torch.distributed.tensor import DTensor, Replicate

    def replicate(x: torch.Tensor) -> DTensor:
        return DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False)

    if args:
        return (replicate(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": replicate(kwargs["hidden_states"])}


def apply_tp_plan(model: torch.nn.Module, tp_mesh, arch: Any, *, experts: bool = True) -> None:
    """Shard the base model's layers over `tp_mesh` in place (paths are relative to its backbone). experts=False:
    the routed experts stay whole here (expert parallelism splits them: models/expert_parallel.py)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan, base = tp_plan(arch), backbone(model)
    if not experts:
        plan = {path: style for path, style in module_plan(plan).items() if style != EXPERTS_STYLE}
    applied = Counter(style for name, _ in base.named_modules()
                      for pattern, style in module_plan(plan).items() if fnmatch(name, pattern))
    parallelize_module(base, tp_mesh, parallel_styles(plan, tp_mesh))
    parents = colwise_parents(plan)
    for name, module in base.named_modules():
        # an MoE layer's `mlp` (router + experts) holds no gate_proj: its experts style replicates its own input
        if any(fnmatch(name, pattern) and hasattr(module, child) for pattern, child in parents.items()):
            module.register_forward_pre_hook(partial(_replicate_input, tp_mesh), with_kwargs=True)
    log.info("tp=%d %s: %s", tp_mesh.size(), arch.model_type,
             ", ".join(f"{style} × {count}" for style, count in sorted(applied.items())))
