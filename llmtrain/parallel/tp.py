"""Tensor parallelism (`backend.tp`): transformers' TP plan on the "tp" mesh (models/tp.py), innermost in the mesh
(tp peers exchange activations in every layer: the fastest links). tp peers read the same examples. Applied first
(everything after sees DTensor shards)."""

from __future__ import annotations

from typing import Any

from llmtrain.parallel.dimension import Dimension, register
from llmtrain.parallel.layout import describe_degrees, divisors_of_all


def divisibility_problems(dims: Any, model_type: str, sizes: dict[str, int | None]) -> list[str]:
    """tp splits attention heads, kv-heads and MLP columns evenly over its ranks."""
    sizes = {name: value for name, value in sizes.items() if value}
    return [f"backend.tp={dims.tp} must divide the model's {name}={value} ({model_type}; "
            f"{describe_degrees(dims.degrees)}, world size {dims.world_size}); "
            f"pick a tp among {divisors_of_all(list(sizes.values()))}"
            for name, value in sizes.items() if value % dims.tp]


def arch_problems(backend: Any, dims: Any, arch: Any) -> list[str]:
    """A TP plan for this architecture, and heads / kv-heads / MLP width divisible by tp."""
    from llmtrain.models.tp import tp_plan_problems

    if dims.tp <= 1:
        return []
    heads = arch.num_attention_heads
    return tp_plan_problems(arch, dims.tp) or divisibility_problems(dims, arch.model_type, {
        "num_attention_heads": heads, "num_key_value_heads": getattr(arch, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(arch, "intermediate_size", None)})


def facts_problems(backend: Any, dims: Any, facts: Any) -> list[str]:
    if dims.tp <= 1:
        return []
    if not facts.tp_params:
        return [f"{facts.model_type} has no tensor-parallel plan in transformers"]
    return divisibility_problems(dims, facts.model_type, {"num_attention_heads": facts.heads,
                                                          "num_key_value_heads": facts.kv_heads,
                                                          "intermediate_size": facts.intermediate})


def plan_line(st: Any, row: Any) -> str:
    lay = row.layout
    return (f"{lay.name}: dp {lay.dp} × tp {lay.tp}, global batch {st.micro * st.accum * lay.dp} rows (tp ranks share "
            "their examples)")


def _views(world, dims) -> dict:
    """"dp_shard_tp": a norm's partial sums over both dims in one all-reduce instead of two."""
    return {"dp_shard_tp": world[("dp_shard", "tp")]._flatten("dp_shard_tp")}


def apply(model, dims) -> None:
    """The family's plan on the decoder layers; the fused LM head (model.fused_loss on) split over the vocabulary."""
    from llmtrain.models.fused_head import fused_head_of
    from llmtrain.models.lora import unwrap_peft
    from llmtrain.models.tp import apply_tp_plan
    from llmtrain.models.vocab_parallel import shard_head_over_vocab

    apply_tp_plan(unwrap_peft(model), dims.mesh("tp"), model.config, experts=dims.ep == 1)  # else ep splits them
    if fused_head_of(model) is not None:  # model.fused_loss=off: the head stays whole, full logits
        shard_head_over_vocab(unwrap_peft(model), dims.mesh("tp"))


TP = register(Dimension(name="tp", position=40, same_data=True,
                        arch_problems=arch_problems, facts_problems=facts_problems, meshes=_views, apply=apply,
                        plan_line=plan_line))
