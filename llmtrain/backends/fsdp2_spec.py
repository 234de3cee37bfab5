"""The FSDP2 backend's descriptor: its typed group, its degrees on ParallelDims (dp_replicate × dp_shard × tp), its
checks, and what the planner says it holds and moves (backends/fsdp2.py is the engine).

Holds per rank (T trainable, F frozen parameters of a role, N dp ranks): fp32 shards 4(T+F)/N (the optimizer's
masters: no separate copy), fp32 gradient shards 4T/N, Adam 8T/N, and the unsharded 16-bit blocks being computed.
With accumulation (no_sync) gradients and weights stay unsharded between micro-batches: 4T whole gradients and every
weight gathered. TP splits the fraction of parameters its plan covers by t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.backends.spec import BackendSpec, pp_of, sp_of
from llmtrain.config import BackendNode
from llmtrain.metrics.cost import Collective, Layout, RoleParams, StateBytes
from llmtrain.parallel import ParallelDims


@dataclass
class FSDP2Config(BackendNode):
    """`backend=fsdp2` / `fsdp2_tp`: world = dp_replicate × dp_shard × sp × tp; dp_shard -1 = infer."""
    name: str = "fsdp2"
    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1  # Ulysses sequence parallelism (models/ulysses.py)
    tp: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    compile: bool = False
    pp: int = 1  # pipeline stages (backends/pipeline.py); world = pp × dp_replicate × dp_shard × sp × tp
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zb | zbv (zero-bubble: reshard_after_forward=false)
    pp_virtual_stages: int = 1  # stages per rank (interleaved_1f1b: >= 2; zbv: 2)


def degrees(backend: Any) -> dict[str, int]:
    return {"dp_replicate": backend.dp_replicate, "dp_shard": backend.dp_shard, "sp": sp_of(backend), "tp": backend.tp,
            "pp": pp_of(backend)}


def problems(backend: Any, world_size: int) -> list[str]:
    """world = pp × dp_replicate × dp_shard × sp × tp (dp_shard -1: inferred); the pipeline's own fields."""
    from llmtrain.backends.pipeline_checks import schedule_problems, unsupported_settings

    pp, sp = pp_of(backend), sp_of(backend)
    found = ParallelDims.problems(backend.dp_replicate, backend.dp_shard, backend.tp, world_size, sp=sp, pp=pp)
    if pp > 1:
        found += schedule_problems(backend) + unsupported_settings(backend)
    if pp > 1 and sp > 1:
        found.append(f"backend.pp={pp} with backend.sp={sp}: pipeline stages over sequence shards are not supported "
                     "yet (neither is tested with the other); use one of them")
    return found


def model_problems(backend: Any, world_size: int, arch: Any) -> list[str]:
    """With tp > 1: a TP plan for this architecture, and heads / kv-heads / MLP width divisible by tp; with sp > 1,
    heads that split over sp × tp (models/ulysses_checks.py). With pp > 1: enough blocks for the stages, the names
    the split works on, no experts."""
    if problems(backend, world_size):
        return []
    return _pipeline_model_problems(backend, arch) + _tp_model_problems(backend, world_size, arch)


def _pipeline_model_problems(backend: Any, arch: Any) -> list[str]:
    from llmtrain.backends.pipeline_checks import model_problems as pipeline_model_problems

    if pp_of(backend) <= 1:
        return []
    from llmtrain.backends.pipeline import has_layer_stack
    from llmtrain.models.moe import expert_count

    return pipeline_model_problems(backend, arch.num_hidden_layers, expert_count(arch) or 0, arch.model_type,
                                   has_layer_stack(arch), tied=bool(getattr(arch, "tie_word_embeddings", False)))


def _tp_model_problems(backend: Any, world_size: int, arch: Any) -> list[str]:
    from llmtrain.models.tp import tp_plan_problems
    from llmtrain.models.ulysses_checks import sp_model_problems

    sp_found = sp_model_problems(sp_of(backend), backend.tp, arch)
    if backend.tp <= 1 or sp_found:
        return sp_found
    plan_problems = tp_plan_problems(arch, backend.tp)
    if plan_problems:
        return plan_problems
    dims = ParallelDims.build(backend.dp_replicate, backend.dp_shard, backend.tp, world_size, sp=sp_of(backend),
                              pp=pp_of(backend))
    heads = arch.num_attention_heads
    return dims.model_problems(model_type=arch.model_type, num_heads=heads,
                               num_kv_heads=getattr(arch, "num_key_value_heads", None) or heads,
                               intermediate_size=getattr(arch, "intermediate_size", None))


def plan_problems(backend: Any, world_size: int, facts: Any) -> list[str]:
    """model_problems on the planner's model facts (no transformers config at hand)."""
    from llmtrain.backends.pipeline_checks import model_problems as pipeline_model_problems
    from llmtrain.models.ulysses_checks import sp_facts_problems

    pipeline = pipeline_model_problems(backend, facts.layers, 0, facts.model_type) if pp_of(backend) > 1 else []
    sp_found = sp_facts_problems(sp_of(backend), backend.tp, facts)
    if backend.tp <= 1 or sp_found:
        return pipeline + sp_found
    if not facts.tp_params:
        return [*pipeline, f"{facts.model_type} has no tensor-parallel plan in transformers"]
    return pipeline + ParallelDims.build(backend.dp_replicate, backend.dp_shard, backend.tp, world_size,
                                         sp=sp_of(backend), pp=pp_of(backend)).model_problems(
        model_type=facts.model_type, num_heads=facts.heads, num_kv_heads=facts.kv_heads,
        intermediate_size=facts.intermediate)


def holdings(r: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> StateBytes:
    """fp32 shards always; the MixedPrecisionPolicy (bf16 gathers) on a GPU with bf16 only (backends/fsdp2.py)."""
    split = 1 - r.tp_fraction + r.tp_fraction / lay.tp  # per-rank share after TP
    t, f, n = r.trainable * split, r.frozen * split, lay.shards
    w = 2 if on_gpu and precision == "bf16" else 4
    unsharded = accum > 1 and t > 0  # no_sync: gradients and weights kept whole between micro-batches
    s = StateBytes(weights=4 * (t + f) / n, master=0.0, grads=4 * t if unsharded else 4 * t / n, optim=8 * t / n,
                   gathered=w * (t + f) if unsharded else w * r.working * split)
    if lay.offload_param == "cpu":  # CPUOffloadPolicy: shards, gradients and the optimizer step on the host
        return StateBytes(s.weights, s.master, s.grads, s.optim, s.gathered, host=s.weights + s.grads + s.optim)
    return s


def collectives(role: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> list[Collective]:
    """The root (embeddings, head) is not resharded after forward; gradients reduce on the last micro-batch."""
    t, f, n, k = role.trainable, role.frozen, lay.shards, accum
    split = 1 - role.tp_fraction + role.tp_fraction / lay.tp
    wg = 2 if on_gpu and precision == "bf16" else 4
    whole, blocks = wg * (t + f) * split, wg * (t + f) * split * role.block_fraction
    if not t:
        return [Collective("weights, forward", "all_gather", whole, n, k)]
    # no_sync keeps every unit gathered after each backward but the last's: one forward gather a step; blocks
    # resharded after each forward are gathered again in each backward (measured, tests/dist)
    out = [Collective("weights, forward", "all_gather", whole, n)]
    if lay.reshard_after_forward:
        out.append(Collective("weights, backward", "all_gather", blocks, n, k))
    out.append(Collective("gradients", "reduce_scatter", 4 * t * split, n))
    return out


def gathers(lay: Layout, facts: Any) -> tuple[int, float | None]:
    """Two blocks and the root unit (embeddings, final norm, head: one group, gathered whole) at once."""
    return 2 * facts.block + facts.params - facts.layers * facts.block, None


def layout(name: str, backend: FSDP2Config, dims: ParallelDims, hidden: int) -> Layout:
    return Layout(name=name, backend=SPEC, stage=3, dp=dims.dp_size, tp=dims.tp, sp=dims.sp,
                  offload_param="cpu" if backend.cpu_offload else "none",
                  reshard_after_forward=backend.reshard_after_forward,
                  head_tp=dims.tp if dims.pp == 1 else 1)  # the pipeline keeps its last stage's head whole


SPEC = BackendSpec(name="fsdp2", engine="llmtrain.backends.pipeline_engine:FSDP2PipelineBackend",
                   config_class=FSDP2Config,
                   presets=("fsdp2", "fsdp2_tp"), compared=("fsdp2", "fsdp2_tp"), degrees=degrees,
                   problems=problems, model_problems=model_problems, plan_problems=plan_problems, layout=layout,
                   row_name=lambda backend: backend.name + ("_tp" if backend.tp > 1 else ""), holdings=holdings,
                   collectives=collectives, gathers=gathers)
