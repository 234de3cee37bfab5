"""Tensor-parallel plans: transformers' `base_model_tp_plan`, turned into torch ParallelStyles.

A plan maps module paths under the base model (`layers.*.self_attn.q_proj`) to a style name. We map
only the two Megatron styles: "colwise" (q/k/v, gate/up: output features split, bias split with them)
and "rowwise" (o_proj, down_proj: input features split, partial sums all-reduced to a replicated
output). Each attention block thus holds `heads / tp` query heads and `kv_heads / tp` kv-heads on
every rank; transformers' attention reshapes with `view(..., -1, head_dim)`, so it runs on the local
heads without knowing, while `config.num_attention_heads` stays the global count (what is saved and
exported). Column chunks are contiguous, so rank r holds query heads [r·H/tp, (r+1)·H/tp) and exactly
the kv-heads those query heads use under GQA (head i reads kv-head i // (H/KV)).

Not sharded, stated here once: the token embedding, the final norm and the LM head stay replicated
across the tp group (FSDP still shards them over dp), so every tp rank computes the full logits
(B, T, V) and the same loss; no loss-parallel. That costs V·h of memory per tp rank and duplicated
LM-head FLOPs, which is the price of using transformers' plans unchanged.

Families transformers ships no plan for (GPT-2: fused c_attn, Conv1D) are refused before the model
loads; add a plan to EXTRA_TP_PLANS (keyed by model_type) only together with a parity test.
"""

from __future__ import annotations

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


def apply_tp_plan(model: torch.nn.Module, tp_mesh, arch: Any) -> None:
    """Shard the base model's Linear layers over `tp_mesh` in place (paths are relative to base_model)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(arch)
    parallelize_module(model.base_model, tp_mesh, parallel_styles(plan))
