"""Process-group set-up and the few collectives the trainer needs.

One code path for every launch: under torchrun (or the deepspeed launcher) the rendezvous variables
are set; under plain `python -m llmtrain` we set them for a world of one, so every backend sees an
initialised process group (and DeepSpeed does not go looking for MPI).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_rendezvous_env() -> None:
    """Fill in a single-process rendezvous when no launcher did."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def resolve_device(preference: str) -> torch.device:
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if use_cuda:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device_preference: str, timeout_s: int) -> DistContext:
    ensure_rendezvous_env()
    device = resolve_device(device_preference)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return DistContext(dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), dist.get_world_size(), device)


def all_reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a small tensor over `group` (default: all ranks), in place, and return it."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
