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

Families transformers ships no plan for (GPT-2: fused c_attn, Conv1D) are refused before the model
loads; add a plan to EXTRA_TP_PLANS (keyed by model_type) only together with a parity test.
"""

from __future__ import annotations

from fnmatch import fnmatch
from functools import partial
from typing import Any

import torch

EXTRA_TP_PLANS: dict[str, dict[str, str]] = {}  # model_type -> {module path pattern: style}
SUPPORTED_STYLES = ("colwise", "rowwise")
WORKING_BACKENDS = "backend=fsdp2 (backend.tp=1), backend=ddp or backend=deepspeed"


def tp_plan(arch: Any) -> dict[str, str] | None:
    """The plan for this architecture config (None: it has none)."""
    return EXTRA_TP_PLANS.get(arch.model_type) or getattr(arch, "base_model_tp_plan", None) or None


def tp_plan_problems(arch: Any, tp: int) -> list[str]:
    """Why this architecture cannot run at this tp degree (empty: it can). Reads the config only."""
    if tp == 1:
        return []
    plan = tp_plan(arch)
    if plan is None:
        return [f"backend.tp={tp}: model_type {arch.model_type!r} ({type(arch).__name__}) has no "
                f"tensor-parallel plan (transformers' base_model_tp_plan is empty), so its weights cannot "
                f"be sharded correctly; use {WORKING_BACKENDS}"]
    unknown = sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})
    if unknown:
        return [f"backend.tp={tp}: model_type {arch.model_type!r}'s tensor-parallel plan uses style(s) "
                f"{', '.join(unknown)}, which llmtrain does not map (only {', '.join(SUPPORTED_STYLES)}); "
                f"use {WORKING_BACKENDS}"]
    return []


def parallel_styles(plan: dict[str, str]) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # use_local_output (default): activations between the Linear layers stay plain local tensors, so
    # attention, rotary embeddings and the MLP activation run unchanged on the local heads/columns.
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {path: styles[style]() for path, style in plan.items()}


def colwise_parents(plan: dict[str, str]) -> list[str]:
    """The sub-blocks whose input the colwise projections read: `layers.*.self_attn`, `layers.*.mlp`."""
    return sorted({path.rsplit(".", 1)[0] for path, style in plan.items() if style == "colwise"})


def _replicate_input(tp_mesh, module, args, kwargs):
    """Forward pre-hook: the sub-block's input (first argument, or `hidden_states=`) as a Replicate DTensor;
    the colwise projections take it as it is, and its gradient is all-reduced once, here."""
    from torch.distributed.tensor import DTensor, Replicate

    def replicate(x: torch.Tensor) -> DTensor:
        return DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False)

    if args:
        return (replicate(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": replicate(kwargs["hidden_states"])}


def apply_tp_plan(model: torch.nn.Module, tp_mesh, arch: Any) -> None:
    """Shard the base model's Linear layers over `tp_mesh` in place (paths are relative to base_model)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(arch)
    parallelize_module(model.base_model, tp_mesh, parallel_styles(plan))
    blocks = colwise_parents(plan)
    for name, module in model.base_model.named_modules():
        if any(fnmatch(name, pattern) for pattern in blocks):
            module.register_forward_pre_hook(partial(_replicate_input, tp_mesh), with_kwargs=True)
