"""The FSDP2 backend's descriptor: its typed group (whose degree fields are the parallel dimensions it runs: dp, tp,
sp, pp, ep; their checks are theirs, parallel/), and what the planner says it holds and moves (backends/fsdp2.py is
the engine).

Holds per rank (T trainable, F frozen parameters of a role, N dp ranks): fp32 shards 4(T+F)/N (the optimizer's
masters: no separate copy), fp32 gradient shards 4T/N, Adam 8T/N, and the unsharded 16-bit blocks being computed.
With accumulation (no_sync) gradients and weights stay unsharded between micro-batches: 4T whole gradients and every
weight gathered. TP splits the fraction of parameters its plan covers by t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.backends.spec import BackendSpec
from llmtrain.config import BackendNode
from llmtrain.metrics.cost import Collective, Layout, RoleParams, StateBytes, muon_gathers
from llmtrain.optim.spec import MUON_FIX


@dataclass
class FSDP2Config(BackendNode):
    """`backend=fsdp2` / `fsdp2_tp`: world = dp_replicate × dp_shard × cp × sp × tp; dp_shard -1 = infer."""
    name: str = "fsdp2"
    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1  # Ulysses sequence parallelism (models/ulysses.py)
    cp: int = 1  # context parallelism: ring attention (models/ring_attention.py)
    cp_implementation: str = "auto"  # ring | torch (torch's context_parallel, CUDA) | auto (parallel/cp.py)
    ep: int = 1  # expert parallelism, carved from dp_shard × tp (parallel/ep.py)
    tp: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    compile: bool = False
    pp: int = 1  # pipeline stages (backends/pipeline.py); world = pp × dp_replicate × dp_shard × sp × tp
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zb | zbv (zero-bubble: reshard_after_forward=false)
    pp_virtual_stages: int = 1  # stages per rank (interleaved_1f1b: >= 2; zbv: 2)


def holdings(r: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> StateBytes:
    """fp32 shards always; the MixedPrecisionPolicy (bf16 gathers) on a GPU with bf16 only (backends/fsdp2.py). Under
    ep a rank keeps E/ep of the routed experts whole, sharded over efsdp = dp·tp/ep (E/(dp·tp) each)."""
    dense, experts = _splits(r, lay)
    whole, sharded = dense + experts, dense / lay.shards + experts / lay.efsdp
    t, f = r.trainable, r.frozen
    w = 2 if on_gpu and precision == "bf16" else 4
    unsharded = accum > 1 and t > 0  # no_sync: gradients and weights kept whole between micro-batches
    s = StateBytes(weights=4 * (t + f) * sharded, master=0.0, grads=4 * t * (whole if unsharded else sharded),
                   optim=4 * r.optim_floats * t * sharded,
                   gathered=w * (t + f) * whole if unsharded else w * r.working * dense)
    if lay.offload_param == "cpu":  # CPUOffloadPolicy: shards, gradients and the optimizer step on the host
        return StateBytes(s.weights, s.master, s.grads, s.optim, s.gathered, host=s.weights + s.grads + s.optim)
    return s


def _splits(r: RoleParams, lay: Layout) -> tuple[float, float]:
    """(dense, experts): the shares of a role's parameters one rank holds gathered. TP splits its plan's fraction by t;
    under ep the experts leave that plan and split by ep."""
    return 1 - r.tp_fraction - r.expert_fraction + r.tp_fraction / lay.tp, r.expert_fraction / lay.ep


def collectives(role: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> list[Collective]:
    """The root (embeddings, head) is not resharded after forward; gradients reduce on the last micro-batch. Under ep
    a rank's experts are gathered and reduced over efsdp, the rest over dp × sp."""
    t, f, k = role.trainable, role.frozen, accum
    dense, experts = _splits(role, lay)
    wg = 2 if on_gpu and precision == "bf16" else 4
    out = []
    # (share, ranks it is sharded over, label, the part of it in decoder blocks: the experts are all in blocks)
    parts = ((dense, lay.shards, "", role.block_fraction), (experts, lay.efsdp, "experts ", 1.0))
    for share, n, what, in_blocks in parts:
        if not share:
            continue
        whole, blocks = wg * (t + f) * share, wg * (t + f) * share * in_blocks
        if not t:
            out.append(Collective(f"{what}weights, forward", "all_gather", whole, n, k))
            continue
        # no_sync keeps every unit gathered after each backward but the last's: one forward gather a step; blocks
        # resharded after each forward are gathered again in each backward (measured, tests/dist)
        out.append(Collective(f"{what}weights, forward", "all_gather", whole, n))
        if lay.reshard_after_forward:
            out.append(Collective(f"{what}weights, backward", "all_gather", blocks, n, k))
        out.append(Collective(f"{what}gradients", "reduce_scatter", 4 * t * share, n))
    return out + muon_gathers(role, lay.shards * lay.tp)


def gathers(lay: Layout, facts: Any) -> tuple[int, float | None]:
    """Two blocks and the root unit (embeddings, final norm, head: one group, gathered whole) at once; under ep a block
    holds its rank's E/ep experts."""
    absent = facts.expert_params * (1 - 1 / lay.ep) / max(facts.moe_layers, 1) if lay.ep > 1 else 0
    return 2 * (facts.block - absent) + facts.params - facts.layers * facts.block, None


def optimizer_problems(backend: FSDP2Config, cfg) -> list[str]:
    """Muon gathers each sharded matrix on the device's process group: not from host shards, not per pipeline stage."""
    if cfg.optim.name != "muon":
        return []
    problems = []
    if backend.pp > 1:
        problems.append(f"optim=muon with backend.pp={backend.pp}: the pipeline engine builds its own AdamW per stage, "
                        f"and Muon there is not wired up or tested: {MUON_FIX} backend.pp=1")
    if backend.cpu_offload:
        problems.append(f"optim=muon with backend.cpu_offload=true: the shards the update gathers live in host memory, "
                        f"which the GPU process group does not gather: {MUON_FIX} backend.cpu_offload=false")
    return problems


def layout(name: str, backend: FSDP2Config, dims: Any, hidden: int) -> Layout:
    return Layout(name=name, backend=SPEC, stage=3, dp=dims.dp_size, tp=dims.tp, sp=dims.sp, cp=dims.cp, ep=dims.ep,
                  offload_param="cpu" if backend.cpu_offload else "none",
                  reshard_after_forward=backend.reshard_after_forward,
                  head_tp=dims.tp if dims.pp == 1 else 1)  # the pipeline keeps its last stage's head whole


SPEC = BackendSpec(name="fsdp2", engine="llmtrain.backends.pipeline_engine:FSDP2PipelineBackend",
                   config_class=FSDP2Config,
                   presets=("fsdp2", "fsdp2_tp"), compared=("fsdp2", "fsdp2_tp"), layout=layout,
                   row_name=lambda backend: backend.name + ("_tp" if backend.tp > 1 else ""), holdings=holdings,
                   collectives=collectives, gathers=gathers, optimizer_problems=optimizer_problems)
