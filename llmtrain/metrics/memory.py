"""Model-state bytes per rank: what a backend really holds, next to the formula it should follow.

docs/formulas.md (fp32 training, M parameters, N data-parallel ranks): weights 4M, gradients 4M, Adam m+v 8M,
16M in all, sharded per ZeRO stage — DDP/ZeRO-0 16M, ZeRO-1 8M + 8M/N, ZeRO-2 4M + 12M/N, ZeRO-3 16M/N.
`deepspeed_expected` adjusts it for what DeepSpeed really keeps:
- a separate fp32 master partition (4M/N) in ZeRO-1/2/3 even when the weights are already fp32;
- ZeRO-3 keeps parameters with numel <= stage3_param_persistence_threshold whole on every rank (4P);
- with optimizer offload the master, Adam state and (ZeRO-3) gradient partitions live in host memory,
  with parameter offload the ZeRO-3 weight partitions too.
Communication buckets and staging buffers are measured and reported apart (`buffers`), not in the total.

`StorageLedger` does the measuring: tensors are added under a role, each storage counted once (views of a
flat buffer are one storage), meta tensors never; `gather_per_rank` puts every rank's numbers in one record.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

ROLES = ("params", "master", "grads", "optim", "buffers", "other")


def deepspeed_expected(*, num_params: int, persistent_params: int, stage: int, dp: int, grad_accum_steps: int,
                       offload_optimizer: bool, offload_param: bool, elem_bytes: int = 4, frozen_params: int = 0,
                       frozen_persistent_params: int = 0) -> dict[str, float]:
    """Bytes per rank per role for fp32 training under DeepSpeed (see the module docstring); `host` says
    how much of them offload puts in host memory. Gradients are measured after each micro-batch's backward:
    ZeRO-0/1 hold them whole between micro-batches; ZeRO-1 with no accumulation only inside backward.
    `num_params` are the trainable ones; `frozen_params` (a LoRA base) count as weights only."""
    m, p, n, b = num_params, persistent_params, dp, elem_bytes
    f, fp = frozen_params, frozen_persistent_params
    shard = m / n if stage >= 1 else m
    whole_grads = stage == 0 or (stage == 1 and grad_accum_steps > 1)
    expected = {
        "params": b * (m / n + p + f / n + fp) if stage == 3 else b * (m + f),
        "master": b * m / n if stage >= 1 else 0.0,  # DeepSpeed's fp32 copy of this rank's partition
        "grads": b * m if whole_grads else b * m / n,
        "optim": 2 * b * shard,  # Adam exp_avg + exp_avg_sq
    }
    expected["host"] = 0.0
    if offload_optimizer:
        expected["host"] += expected["master"] + expected["optim"] + (expected["grads"] if stage == 3 else 0.0)
    if offload_param and stage == 3:
        expected["host"] += b * (m + f) / n
    return expected


def formula_16m(*, num_params: int, stage: int, dp: int, elem_bytes: int = 4) -> float:
    """docs/formulas.md unadjusted: fp32 weights + grads + Adam = 16M, split per ZeRO stage."""
    m, n, b = num_params, dp, elem_bytes
    return {0: 4 * b * m, 1: 2 * b * m + 2 * b * m / n, 2: b * m + 3 * b * m / n, 3: 4 * b * m / n}[stage]


def planned_model_state_bytes(*, num_params: int, stage: int, dp: int, mixed_precision: bool) -> float:
    """Per-rank model states from docs/formulas.md: mixed-precision Adam (16-bit weights and grads, fp32 master
    + m + v) = 4M + 12M/N (ZeRO-1), 2M + 14M/N (ZeRO-2), 16M/N (ZeRO-3 / FSDP), 16M (DDP); fp32: 16M split
    the same way. Activations are not included."""
    if not mixed_precision:
        return formula_16m(num_params=num_params, stage=stage, dp=dp)
    m, n = num_params, dp
    return {0: 16 * m, 1: 4 * m + 12 * m / n, 2: 2 * m + 14 * m / n, 3: 16 * m / n}[stage]


def frozen_elem_bytes(in_compute_dtype: bool, mixed_precision: bool) -> int:
    """Bytes per frozen parameter: 2 where the backend casts a frozen module to the 16-bit compute dtype (its
    descriptor's `frozen_in_compute_dtype`: DeepSpeed), else 4 (fp32 weights under autocast, or FSDP2's fp32 shards
    with a bf16 all-gather)."""
    return 2 if in_compute_dtype and mixed_precision else 4


def planned_state_bytes(*, trainable: int, frozen: int, stage: int, dp: int, mixed_precision: bool,
                        frozen_elem_bytes: int) -> float:
    """Per-rank model states of a role whose `frozen` parameters (a LoRA base) are weights only (`frozen_elem_bytes`
    each: the dtype the backend keeps them in, sharded under ZeRO-3 / FSDP) and whose `trainable` ones (the
    adapters) have weights, grads and Adam states as planned_model_state_bytes says. Activations not included."""
    frozen_bytes = frozen * frozen_elem_bytes / (dp if stage == 3 else 1)
    return frozen_bytes + planned_model_state_bytes(num_params=trainable, stage=stage, dp=dp,
                                                    mixed_precision=mixed_precision)


class StorageLedger:
    """Bytes per role, each underlying storage counted once (the first role to claim it keeps it)."""

    def __init__(self):
        self.seen: dict[int, str] = {}
        self.bytes: dict[str, int] = defaultdict(int)
        self.names: dict[str, set[str]] = defaultdict(set)

    def add(self, role: str, name: str, tensors: Iterable) -> None:
        for tensor in _tensors(tensors):
            if tensor.device.type == "meta" or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen:
                continue
            self.seen[key] = role
            self.bytes[role] += storage.nbytes()
            self.names[role].add(name)

    def total(self, roles: Iterable[str]) -> int:
        return sum(self.bytes[r] for r in roles)


def _tensors(obj, depth: int = 0):
    """Tensors inside nested lists / tuples / dicts (a few levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth + 1)


def gather_per_rank(local: dict[str, float], world_size: int, rank: int, device: torch.device,
                    prefix: str = "memory") -> dict[str, float]:
    """Every rank's `local` (same keys everywhere) as one flat record: `<prefix>_r<rank>_<key>`. A collective."""
    from llmtrain.distributed import all_reduce_sum

    keys = sorted(local)
    table = torch.zeros(world_size, len(keys), dtype=torch.float64, device=device)
    table[rank] = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=device)
    all_reduce_sum(table)
    return {f"{prefix}_r{r}_{k}": table[r, i].item() for r in range(world_size) for i, k in enumerate(keys)}
