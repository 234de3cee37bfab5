"""The devices the planner knows (`plan.gpu`): dense bf16 peak, memory, collective bandwidth per rank.

Peaks as docs/formulas.md uses them (A100 312, H100 SXM / H200 989, RTX 4090 165 TFLOP/s); memory as nvidia-smi
reports it, in GiB; link: NVLink one way per GPU (A100 300, H100/H200 450 GB/s), PCIe 4.0 x16 for a 4090 (~25 GB/s
in practice, no P2P). A CPU has no honest peak: the plan reports no step time or MFU there unless
plan.peak_tflops is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmtrain.config import ConfigError

GIB = 2 ** 30


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_tflops: float | None  # dense bf16; None: no honest peak (CPU)
    memory_gib: float  # what the device reports (nvidia-smi's total)
    link_gb_per_s: float  # per-rank collective bandwidth, one way (NVLink within a node; PCIe for a 4090)


GPUS = {g.name: g for g in (
    Gpu("a100-40gb", 312, 40.0, 300), Gpu("a100-80gb", 312, 80.0, 300), Gpu("h100-80gb", 989, 79.6, 450),
    Gpu("h200", 989, 140.4, 450), Gpu("rtx-4090", 165, 24.0, 25),
    Gpu("cpu", None, 0.0, 5))}  # cpu: host RAM (filled in at run time) shared by the ranks; gloo ~5 GB/s assumed
ALIASES = {"h100": "h100-80gb", "h200-141gb": "h200", "rtx4090": "rtx-4090", "4090": "rtx-4090", "a100": "a100-80gb"}


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def resolve_gpu(plan, device_type: str = "cpu", world: int = 1) -> Gpu:
    """plan.gpu (null: this machine's device) with plan.peak_tflops / memory_gb / link_gb_per_s over the table's
    values. cpu: the host RAM split over the `world` ranks that share it. A named device not in the table needs
    both peak and memory; this machine's GPU, when not in the table, is planned with its own memory and no peak."""
    detected = detect_gpu(device_type) if plan.gpu is None else None
    name = plan.gpu if plan.gpu is not None else detected.name
    known = GPUS.get(ALIASES.get(name.lower(), name.lower())) or detected
    if known is None and (plan.peak_tflops is None or plan.memory_gb is None):
        raise ConfigError(f"plan.gpu={name!r} is not a known device ({', '.join(GPUS)}): pick one, or give "
                          f"plan.peak_tflops=<dense bf16 TFLOP/s> and plan.memory_gb=<GiB> for it")
    base = known or Gpu(name, None, 0.0, 25)
    memory = base.memory_gib if base.name != "cpu" else host_memory_gib() / world
    return Gpu(base.name, plan.peak_tflops if plan.peak_tflops is not None else base.peak_tflops,
               plan.memory_gb if plan.memory_gb is not None else memory,
               plan.link_gb_per_s if plan.link_gb_per_s is not None else base.link_gb_per_s)


def detect_gpu(device_type: str) -> Gpu:
    """This machine's device: a table entry by its name, else its own memory and no peak."""
    if device_type != "cuda":
        return GPUS["cpu"]
    import torch

    label, memory = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / GIB
    for key, name in (("H200", "h200"), ("H100", "h100-80gb"), ("4090", "rtx-4090")):
        if key in label:
            return GPUS[name]
    if "A100" in label:
        return GPUS["a100-80gb" if memory > 45 else "a100-40gb"]
    return Gpu(label, None, memory, 25)
