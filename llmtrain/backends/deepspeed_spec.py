"""The DeepSpeed backend's descriptor: its typed group (deepspeed_config.DeepSpeedConfig), its checks, and what the
planner says it holds and moves (backends/deepspeed.py is the engine; only it and
its checkpoints' half, deepspeed_checkpoint.py, import deepspeed).

Holds per rank (T trainable, F frozen parameters of a role, N dp ranks, w bytes of the 16-bit working copy: 2 under
bf16/fp16, 4 in fp32; P parameters ZeRO-3 keeps whole): 16-bit weights w(T+F); an fp32 master partition 4T/N at
ZeRO-1/2/3 also in fp32 runs; gradients fp32 (bf16_gradient_dtypes): ZeRO-1 whole 4T under bf16 (BF16_Optimizer)
or with accumulation, ZeRO-2/3 a 4T/N partition; ZeRO-0 keeps 16-bit gradients 2T and a whole fp32 master 4T under
bf16. ZeRO-3 weights w((T+F)/N + P), plus the modules gathered at once. Offload puts master + Adam (+ ZeRO-3
gradients) and, with parameter offload, the ZeRO-3 weight partitions in host memory or on NVMe.
"""

from __future__ import annotations

from llmtrain.backends.deepspeed_config import DeepSpeedConfig, deepspeed_problems
from llmtrain.backends.spec import BackendSpec
from llmtrain.metrics.cost import (
    OFF_DEVICE,
    Collective,
    Layout,
    RoleParams,
    StateBytes,
    elem_bytes,
    grad_elem_bytes,
    muon_gathers,
)
from llmtrain.optim.spec import MUON_FIX

ZERO3_MAX_REUSE_DISTANCE = 1e9  # DeepSpeed's stage3_max_reuse_distance default (numel); llmtrain does not set it


def holdings(r: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> StateBytes:
    t, f, n, w, mixed = r.trainable, r.frozen, lay.shards, elem_bytes(precision), elem_bytes(precision) == 2
    if lay.stage == 0:
        return StateBytes(weights=w * (t + f), master=4 * t if mixed else 0.0, grads=w * t,
                          optim=4 * r.optim_floats * t, gathered=0.0)
    whole_grads = lay.stage == 1 and (mixed or accum > 1)
    s = StateBytes(weights=w * ((t + f) / n + r.persistent) if lay.stage == 3 else w * (t + f), master=4 * t / n,
                   grads=4 * t if whole_grads else 4 * t / n, optim=4 * r.optim_floats * t / n,
                   gathered=w * r.working if lay.stage == 3 else 0.0)
    off = {"cpu": 0.0, "nvme": 0.0}
    if lay.offload_optimizer in OFF_DEVICE:
        off[lay.offload_optimizer] += s.master + s.optim + (s.grads if lay.stage == 3 else 0.0)
    if lay.offload_param in OFF_DEVICE and lay.stage == 3:
        off[lay.offload_param] += w * (t + f) / n
    return StateBytes(s.weights, s.master, s.grads, s.optim, s.gathered, host=off["cpu"], nvme=off["nvme"])


def collectives(role: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> list[Collective]:
    t, f, n, w, k, g = role.trainable, role.frozen, lay.shards, elem_bytes(precision), accum, grad_elem_bytes(precision)
    if lay.stage == 0:
        return [Collective("gradients", "all_reduce", g * t, n)]
    if lay.stage in (1, 2):
        bf16_zero1 = lay.stage == 1 and precision == "bf16"
        return [Collective("gradients", "all_reduce" if bf16_zero1 else "reduce", g * t, n, k if lay.stage == 2 else 1),
                Collective("updated weights", "all_gather", w * t, n), *muon_gathers(role, n)]
    gathered = w * max(0.0, t + f - role.persistent)  # ZeRO-3: persistent parameters are never gathered
    again = gathered if role.regathered is None else w * role.regathered
    out = [Collective("weights, forward", "all_gather", gathered, n, k)]
    if t and again:
        out.append(Collective("weights, backward", "all_gather", again, n, k))
    if t:
        out.append(Collective("gradients", "reduce_scatter", g * t, n, k))
    return out + muon_gathers(role, n)


def zero3_regathered(layers: int, block: int, embed: int, head: int,
                     reuse_distance: float = ZERO3_MAX_REUSE_DISTANCE) -> float:
    """Parameters ZeRO-3 gathers again for backward. After a module's forward DeepSpeed keeps its parameters when
    they are used again within `reuse_distance` numel of the recorded trace: block l's next use is its own
    backward, 2·(L-1-l)·B + 2·head numel later; the embedding's 2·L·B + 2·head later; the head's at once. A model
    smaller than the distance (the tiny test models) is gathered once per micro-batch; for Llama-2-7B blocks 0-29 and
    the embedding are gathered again, blocks 30-31 and the head are not (counted in tests/dist, live)."""
    again = sum(block for layer in range(layers) if 2 * (layers - 1 - layer) * block + 2 * head >= reuse_distance)
    return again + (embed if 2 * layers * block + 2 * head >= reuse_distance else 0)


def gathers(lay: Layout, facts) -> tuple[int, float | None]:
    """Two blocks and the largest other module gathered at once (ZeRO-3 gathers module by module); ZeRO-3 gathers
    again in backward what its trace does not keep (a block's few persistent norm weights counted in: < 0.01 % of a
    7B block)."""
    working = 2 * facts.block + max(facts.embed, facts.head)
    regathered = zero3_regathered(facts.layers, facts.block, facts.embed, facts.head) if lay.stage == 3 else None
    return working, regathered


def layout(name: str, backend: DeepSpeedConfig, dims, hidden: int) -> Layout:
    threshold = backend.stage3_param_persistence_threshold
    return Layout(name=name, backend=SPEC, stage=backend.zero_stage, dp=dims.dp_size, tp=dims.tp, sp=dims.sp,
                  cp=dims.cp, offload_optimizer=backend.offload_optimizer.device,
                  offload_param=backend.offload_param.device,
                  persistence_threshold=10 * hidden if threshold == "auto" else int(threshold))


def optimizer_problems(backend: DeepSpeedConfig, cfg) -> list[str]:
    """Muon reads DeepSpeed's flat partitions (optim/zero_layout.py): not its CPU Adam, not BF16_Optimizer's."""
    if cfg.optim.name != "muon":
        return []
    problems, offload = [], backend.offload_optimizer.device
    if offload != "none":
        problems.append(f"optim=muon with backend.offload_optimizer.device={offload}: DeepSpeed's offload runs its own "
                        f"CPU Adam: {MUON_FIX} backend.offload_optimizer.device=none")
    if backend.zero_stage == 1 and cfg.precision == "bf16":
        problems.append("optim=muon with backend.zero_stage=1 under bf16: DeepSpeed swaps in its BF16_Optimizer, whose "
                        f"partitions llmtrain's Muon does not read: {MUON_FIX} backend.zero_stage=2 (same memory for "
                        "the optimizer state), or precision=fp32")
    return problems


# Measured with 0.19.8: its fast checkpoint engine writes synchronously through DeepNVMe, pinning a host buffer
# (CPU-only torch cannot pin: "Cannot access accelerator device when none is available"); its decoupled engine
# hands the state to a writer process that uses the same fast writer, and commits before the next optimizer step.
NO_ASYNC_SAVE = ("DeepSpeed 0.19.8 has no background writer that works here: its fast checkpoint engine writes in "
                 "the step through DeepNVMe with pinned host buffers (not on the CPU accelerator), and its "
                 "decoupled engine uses that writer from a second process and waits for it at the next optimizer step")


def row_name(backend: DeepSpeedConfig) -> str:
    offload = backend.offload_optimizer.device != "none" or backend.offload_param.device != "none"
    return f"zero{backend.zero_stage}" + ("_offload" if offload else "")


SPEC = BackendSpec(name="deepspeed", engine="llmtrain.backends.deepspeed:DeepSpeedBackend",
                   config_class=DeepSpeedConfig,
                   presets=("deepspeed", "zero0", "zero1", "zero2", "zero3", "zero3_offload"),
                   compared=("zero1", "zero2", "zero3", "zero3_offload"), problems=deepspeed_problems,
                   optimizer_problems=optimizer_problems, updates_in_clip=True,
                   layout=layout, row_name=row_name, holdings=holdings, collectives=collectives, gathers=gathers,
                   frozen_in_compute_dtype=True, no_async_save=NO_ASYNC_SAVE)
