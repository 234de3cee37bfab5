"""Backend config checks that run before anything loads: pure Python, no deepspeed/FSDP import.

`BACKEND_CONFIG_CHECKS[name](backend_cfg, world_size) -> list[str]` sees the config alone;
`BACKEND_MODEL_CHECKS[name](backend_cfg, world_size, arch) -> list[str]` also sees the model's
architecture config (heads, kv-heads, model_type), read from config.json without weights.
Each message names the field and the fix.
"""

from __future__ import annotations

from typing import Any, Callable


def ddp_problems(backend: Any, world_size: int) -> list[str]:
    return []


def fsdp2_problems(backend: Any, world_size: int) -> list[str]:
    """world = dp_replicate × dp_shard × tp (dp_shard -1: inferred)."""
    from llmtrain.parallel import ParallelDims

    return ParallelDims.problems(backend.dp_replicate, backend.dp_shard, backend.tp, world_size)


def fsdp2_model_problems(backend: Any, world_size: int, arch: Any) -> list[str]:
    """With tp > 1: a TP plan for this architecture, and heads / kv-heads / MLP width divisible by tp."""
    from llmtrain.models.tp import tp_plan_problems
    from llmtrain.parallel import ParallelDims

    if backend.tp <= 1 or ParallelDims.problems(backend.dp_replicate, backend.dp_shard, backend.tp, world_size):
        return []
    plan_problems = tp_plan_problems(arch, backend.tp)
    if plan_problems:
        return plan_problems
    dims = ParallelDims.build(backend.dp_replicate, backend.dp_shard, backend.tp, world_size)
    heads = arch.num_attention_heads
    return dims.model_problems(model_type=arch.model_type, num_heads=heads,
                               num_kv_heads=getattr(arch, "num_key_value_heads", None) or heads,
                               intermediate_size=getattr(arch, "intermediate_size", None))


def deepspeed_problems(backend: Any, world_size: int) -> list[str]:
    """zero_stage 0..3, offload devices/paths vs stage, bucket sizes, no overrides of keys llmtrain owns."""
    from llmtrain.backends.deepspeed_config import deepspeed_problems as problems  # pure: no deepspeed import

    return problems(backend, world_size)


BACKEND_CONFIG_CHECKS: dict[str, Callable[[Any, int], list[str]]] = {"ddp": ddp_problems, "fsdp2": fsdp2_problems,
                                                                      "deepspeed": deepspeed_problems}
BACKEND_MODEL_CHECKS: dict[str, Callable[[Any, int, Any], list[str]]] = {"fsdp2": fsdp2_model_problems}
