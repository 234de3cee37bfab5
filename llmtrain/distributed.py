"""Process-group set-up and the few collectives the trainer needs.

One code path for every launch: under torchrun (or the deepspeed launcher) the rendezvous variables
are set; under plain `python -m llmtrain` we set them for a world of one, so every backend sees an
initialised process group (and DeepSpeed does not go looking for MPI).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the rendezvous, a local inference server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_rendezvous_env() -> None:
    """Fill in a single-process rendezvous when no launcher did."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
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


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"  # CPU: bf16 autocast is ~35x slower than fp32 here


def _restart_safe_store(timeout: datetime.timedelta) -> dict:
    """init_process_group's store under a torchrun restart: the keys of this attempt only.

    torchrun's c10d rendezvous shares one TCPStore (hosted by the agent, at the same MASTER_PORT) with every
    attempt of its workers. After a worker died and torchrun restarted them all, the store still holds the
    previous attempt's process-group keys, among them each rank's old gloo/NCCL address: a restarted rank
    that reads one before its peer rewrote it dials a dead port (gloo connectFullMesh: connection refused) or
    waits in init_process_group (past its timeout). Measured (2 CPU ranks, rank 1 SIGKILLed after step 7,
    --max-restarts 1): 3 stale keys in the store before the new init; 3 of 7 restarts finished (2 connection
    refused, 2 hung > 240 s); with each attempt's keys under their own prefix, 10 of 10 (and every run of
    tests/dist/test_faults.py). The attempt number (TORCHELASTIC_RESTART_COUNT) is
    counted by each agent, so it names the same attempt on every rank only when one agent started them all
    (one node); on several nodes the launchers set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead, which makes
    every rendezvous round bootstrap a fresh store on a fresh port.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world, local_world = env_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if world != local_world:  # several agents: their restart counts may differ
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and env_rank() == 0:
            log.warning("torchrun shares its rendezvous store with the workers across restarts on several nodes: a "
                        "restart may fail to connect (stale keys of the previous attempt); launch with "
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (launch/torchrun.sh and slurm/train.sbatch set it)")
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"llmtrain/attempt_{attempt}", store), "rank": env_rank(), "world_size": world}


def init_distributed(device_preference: str, timeout_s: int) -> DistContext:
    ensure_rendezvous_env()
    device = resolve_device(device_preference)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        # On GPUs, gloo beside NCCL: collectives on host tensors (FSDP2 cpu_offload's grad norm over CPU shards,
        # object broadcasts) need a CPU backend; torchtitan does the same.
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo", timeout=timeout,
                                **_restart_safe_store(timeout))
    return DistContext(dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), dist.get_world_size(), device)


def all_reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a small tensor over `group` (default: all ranks), in place, and return it."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def all_reduce_max(values: torch.Tensor, group=None) -> torch.Tensor:
    """Elementwise max of a small tensor over `group` (default: all ranks), in place, and return it."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


def all_gather_rows(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """(n, ...) per rank, the same shape on every rank -> (world·n, ...) in rank order."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


_had_process_group = False  # set once this process joined a process group


def quiesce() -> None:
    """A barrier on every process group this rank belongs to, in creation order (the same on every rank).

    Why: gloo's worker threads drop their reference to each finished work (with its tensors) after signalling it
    done; when that is the last reference, freeing the tensors needs the GIL. A group's destructor joins its
    worker threads while the freeing thread holds the GIL (DDP's Reducer or an engine released at the end of a
    run): the worker waits for the GIL, the destructor for the worker — a hang (seen in a 2-rank DDP run), or at
    interpreter exit an abort. After a barrier every work that held tensors has run; the short sleep (GIL released)
    lets the worker that ran the last one drop it, which it does just after signalling it done."""
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    for group in list(_world.pg_map):
        if dist.get_world_size(group) > 1:
            dist.barrier(group=group)
    time.sleep(0.1)


_abandoned = False  # a collective failed: the process group is not torn down (see abandon_process_group)


def abandon_process_group() -> None:
    """After a failed or timed-out collective, leave the process group as it is: destroying it joins gloo's worker
    thread, which may still be blocked on the stalled peer (measured: rank 0 then never exited, and torchrun
    never learned it had failed). The process exits without it (llmtrain/__main__.py: os._exit)."""
    global _abandoned
    _abandoned = True


def shutdown() -> None:
    """Destroy the process group (not after a failed collective: see abandon_process_group). The success path
    calls `quiesce` first (run.py); an error path does not: a rank that raised alone would wait there for peers
    that are still in the training loop."""
    global _had_process_group
    if dist.is_initialized():
        _had_process_group = True
    if dist.is_initialized() and not _abandoned:
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """Exit with `code`. After a process group, without the interpreter's teardown: gloo's C++ worker threads can
    still hold finished work (tensors with Python references) from groups that other objects keep alive (DeepSpeed's
    and DeviceMesh's sub-groups); freeing them while the interpreter finalises aborts the process ("terminate
    called without an active exception", SIGABRT), which turned finished, fully saved runs into failed jobs about
    once in fifty 2-rank CPU runs here (pytorch/pytorch#179291 describes the mechanism). Everything the run writes
    is closed and fsynced before this point; only stdio and logging are flushed here. (`quiesce` prevents the
    same race while the process still runs.)"""
    if not _had_process_group:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
