"""The DDP backend's descriptor: no fields but its name, plain data parallel over the world, and what the planner
says it holds and moves (backends/ddp.py is the engine).

Holds per rank (T trainable, F frozen parameters of a role): fp32 weights 4(T+F), fp32 gradients 4T (bucket views,
no second copy), Adam 8T; under bf16 autocast caches a 16-bit copy of every trainable weight from forward to
backward (2T "gathered"). Moves the fp32 gradients in one all-reduce per optimizer step (no_sync before).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.backends.spec import BackendSpec
from llmtrain.config import BackendNode
from llmtrain.metrics.cost import Collective, Layout, RoleParams, StateBytes, elem_bytes


@dataclass
class DDPConfig(BackendNode):
    name: str = "ddp"


def holdings(r: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> StateBytes:
    t, f = r.trainable, r.frozen
    return StateBytes(weights=4 * (t + f), master=0.0, grads=4 * t, optim=4 * r.optim_floats * t,
                      gathered=2 * t if elem_bytes(precision) == 2 else 0.0)


def collectives(r: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> list[Collective]:
    return [Collective("gradients", "all_reduce", 4 * r.trainable, lay.dp)]


def layout(name: str, backend: DDPConfig, dims, hidden: int) -> Layout:
    return Layout(name=name, backend=SPEC, stage=0, dp=dims.dp_size, tp=dims.tp)


SPEC = BackendSpec(name="ddp", engine="llmtrain.backends.ddp:DDPBackend", config_class=DDPConfig, presets=("ddp",),
                   compared=("ddp",), layout=layout, row_name=lambda backend: backend.name, holdings=holdings,
                   collectives=collectives, loads_4bit_base=True)
