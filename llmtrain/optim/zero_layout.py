"""Where a Muon matrix lies in DeepSpeed ZeRO's flat fp32 partitions, and how to see it whole.

Under ZeRO-1/2/3 our optimizer steps flat 1-D tensors, not the model's parameters (DeepSpeed replaces each group's
params by this rank's partition before our `step`), so MuonAdamW is told, per flat tensor, which matrices it holds:
- ZeRO-1/2 (DeepSpeedZeroOptimizer): a group's parameters are flattened in order (with DeepSpeed's own alignment
  padding, `round_robin_bit16_offsets`) and cut into equal partitions at arbitrary offsets: a matrix may start on one
  rank and end on another. The whole flat Muon update is all-gathered once per step; each rank orthogonalises the
  matrices that touch its partition and keeps their overlap with it.
- ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): each parameter is split on its own (ds_tensor, padded to equal parts) and a
  sub-group's flat tensor concatenates this rank's parts; each matrix's parts are all-gathered, in the same order
  on every rank.
DeepSpeed's own Muon (0.19.8, deepspeed/runtime/zero/muon) moves the momentum into the gradient reduction and runs
its own Newton-Schulz; torch.optim.Muon's numbers need this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from llmtrain.optim.muon import Piece, orthogonalize


def _all_gather(local: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


@dataclass(frozen=True)
class FlatGroupLayout:
    """ZeRO-1/2: `matrices` (offset in the whole flat group, shape); this rank's partition [start, start + size)."""
    matrices: tuple[tuple[int, tuple[int, ...]], ...]
    start: int
    size: int
    group: object

    def pieces(self, param: torch.Tensor, update: torch.Tensor, hp: dict) -> Iterator[Piece]:
        whole = _all_gather(update, self.group)
        end = self.start + self.size
        for offset, shape in self.matrices:
            numel = math.prod(shape)
            lo, hi = max(offset, self.start), min(offset + numel, end)
            if lo >= hi:
                continue  # held by other ranks only
            ortho = orthogonalize(whole[offset:offset + numel].view(shape), hp).reshape(-1)
            yield param[lo - self.start:hi - self.start], ortho[lo - offset:hi - offset], tuple(shape[-2:])


@dataclass(frozen=True)
class PerParamLayout:
    """ZeRO-3: per matrix (offset in the local flat tensor, part size, shape); this rank is part `rank`."""
    matrices: tuple[tuple[int, int, tuple[int, ...]], ...]
    rank: int
    group: object

    def pieces(self, param: torch.Tensor, update: torch.Tensor, hp: dict) -> Iterator[Piece]:
        for offset, part, shape in self.matrices:
            numel = math.prod(shape)
            whole = _all_gather(update[offset:offset + part], self.group)[:numel]
            ortho = orthogonalize(whole.view(shape), hp).reshape(-1)
            lo, hi = self.rank * part, min((self.rank + 1) * part, numel)
            if lo < hi:
                yield param[offset:offset + hi - lo], ortho[lo:hi], tuple(shape[-2:])


def attach_zero_layouts(ds_optimizer, optimizer) -> None:
    """Tell `optimizer` (MuonAdamW, DeepSpeed's client optimizer) where its Muon matrices lie in `ds_optimizer`'s
    flat partitions. ZeRO-0 steps the parameters themselves: nothing to attach. Any other wrapper (BF16_Optimizer,
    ZeRO-1 under bf16) is refused rather than approximated."""
    from llmtrain.config import ConfigError

    if ds_optimizer is optimizer or not hasattr(optimizer, "layouts"):
        return
    name = type(ds_optimizer).__name__
    if name == "DeepSpeedZeroOptimizer":
        _attach_stage12(ds_optimizer, optimizer)
    elif name == "DeepSpeedZeroOptimizer_Stage3":
        _attach_stage3(ds_optimizer, optimizer)
    elif name not in ("FP16_UnfusedOptimizer", "FP16_Optimizer"):  # ZeRO-0 bf16/fp16: per-parameter fp32 copies
        raise ConfigError(f"optim=muon: DeepSpeed wrapped the optimizer in {name}, whose flat partitions llmtrain's "
                          "Muon does not read: use backend.zero_stage=2 or 3, or optim=adamw")


def _attach_stage12(ds, optimizer) -> None:
    for i, group in enumerate(optimizer.param_groups):
        if not group.get("muon"):
            continue
        ds_group = ds.real_dp_process_group[i]
        offsets, metas = ds.round_robin_bit16_offsets[i], ds.round_robin_bit16_meta[i]
        matrices = tuple((offset, tuple(meta.shape)) for offset, meta in zip(offsets, metas))
        size = ds.partition_size[i]
        flat = ds.single_partition_of_fp32_groups[i]
        optimizer.layouts[id(flat)] = FlatGroupLayout(matrices, dist.get_rank(ds_group) * size, size, ds_group)


def _attach_stage3(ds, optimizer) -> None:
    group = ds.dp_process_group
    for sub, params in enumerate(ds.fp16_groups):
        if not optimizer.param_groups[ds.sub_group_to_group_id[sub]].get("muon"):
            continue
        matrices, offset = [], 0
        for p in params:
            part = p.partition_numel()  # ceil(numel / ranks): each rank's equal, padded part
            matrices.append((offset, part, tuple(p.ds_shape)))
            offset += part
        optimizer.layouts[id(ds.fp32_partitioned_groups_flat[sub])] = PerParamLayout(
            tuple(matrices), dist.get_rank(group), group)
