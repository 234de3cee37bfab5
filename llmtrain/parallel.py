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
from dataclasses import dataclass, field, replace

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


# ---- the layout: named dimensions and their device meshes ------------------------------------------

# The dimensions a run's world splits into, outermost first (the device mesh's order): tp innermost, so TP peers
# are adjacent ranks (on a node: NVLink). A new dimension (pp, cp, ep) is a name here, a field of ParallelDims,
# a degree a backend's config may set, and a column of the planner.
# sp (Ulysses sequence parallelism) sits between dp_shard and tp: sp peers share one sequence and exchange all of
# it in each attention's all-to-alls (4 per layer), more traffic than dp's once-a-step gradients, less than tp's.
DIMS = ("dp_replicate", "dp_shard", "sp", "tp")
# pp: pipeline stages, outermost (stage peers exchange only activations, point to point: the slowest links do);
# a keyword of ParallelDims (default 1), so the positional dimensions above keep their meaning.
PP_DIM = "pp"
# Dimensions no backend has yet: named so a `backend.cp=2` gets a message that says so.
PLANNED_DIMS = {"cp": "context parallelism", "ep": "expert parallelism"}


def _degrees(dp_replicate: int, dp_shard: int, tp: int, sp: int = 1, pp: int = 1) -> str:
    """Every degree of the layout (sp and pp only when set: messages of runs without them read as before)."""
    stages = f"backend.pp={pp} × " if pp > 1 else ""
    with_sp = f" × backend.sp={sp}" if sp != 1 else ""
    return f"{stages}backend.dp_replicate={dp_replicate} × backend.dp_shard={dp_shard}{with_sp} × backend.tp={tp}"


@dataclass(frozen=True)
class ParallelDims:
    """How the world splits: world = dp_replicate × dp_shard × tp (torchtitan's layout, innermost tp).

    dp_replicate: HSDP replica groups (gradients all-reduced between them); dp_shard: ranks that shard
    parameters, gradients and optimizer state (FSDP; DDP and DeepSpeed: every rank, (1, world, 1)); tp:
    tensor-parallel peers, which read the SAME examples. `dp_shard=-1` takes whatever world size is left.
    Every error prints every degree.

    One per run, owned by the backend object that wraps every role: its device meshes are built once, on first
    use (`mesh(name)`), on `device_type`, and handed out by name to every engine. `device_type=None`: arithmetic
    only (the checks, the planner).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    device_type: str | None = None
    sp: int = 1  # Ulysses sequence-parallel peers: one sequence, s/sp tokens each (models/ulysses.py)
    pp: int = 1  # pipeline stages (ranks of one pipeline read the same examples, as tp peers do)
    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @staticmethod
    def problems(dp_replicate: int, dp_shard: int, tp: int, world_size: int, sp: int = 1,
                 pp: int = 1) -> list[str]:
        """Pure arithmetic: what is wrong with these degrees for this world size (empty: fine)."""
        named = {"backend.pp": pp, "backend.dp_replicate": dp_replicate, "backend.sp": sp, "backend.tp": tp}
        bad = [f"{k}={v} must be >= 1" for k, v in named.items() if v < 1]
        if dp_shard < 1 and dp_shard != -1:
            bad.append(f"backend.dp_shard={dp_shard} must be >= 1, or -1 to infer it from the world size")
        degrees = _degrees(dp_replicate, dp_shard, tp, sp, pp)
        if bad:
            return [f"{b} ({degrees}, world size {world_size})" for b in bad]
        if dp_shard == -1:
            fixed = pp * dp_replicate * sp * tp
            if world_size % fixed:
                stages = f"backend.pp={pp} × " if pp > 1 else ""
                with_sp = f" × backend.sp={sp}" if sp != 1 else ""
                return [f"backend.dp_shard=-1 (infer) needs world size {world_size} divisible by "
                        f"{stages}backend.dp_replicate={dp_replicate}{with_sp} × backend.tp={tp} = {fixed}; "
                        f"change {'backend.pp / ' if pp > 1 else ''}backend.tp{' / backend.sp' if sp != 1 else ''} "
                        "/ backend.dp_replicate or the number of processes"]
            return []
        product = pp * dp_replicate * dp_shard * sp * tp
        if product != world_size:
            return [f"{degrees} = {product}, not the world size {world_size} "
                    "(nnodes × nproc_per_node); set backend.dp_shard=-1 to infer it or change the degrees"]
        return []

    @classmethod
    def build(cls, dp_replicate: int, dp_shard: int, tp: int, world_size: int,
              device_type: str | None = None, sp: int = 1, pp: int = 1) -> ParallelDims:
        from llmtrain.config import ConfigError

        problems = cls.problems(dp_replicate, dp_shard, tp, world_size, sp=sp, pp=pp)
        if problems:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
        if dp_shard == -1:
            dp_shard = world_size // (pp * dp_replicate * sp * tp)
        return cls(dp_replicate, dp_shard, tp, world_size, device_type, sp, pp)

    def on(self, device_type: str) -> ParallelDims:
        """The same layout with its meshes on `device_type` (none built yet)."""
        return replace(self, device_type=device_type)

    def model_problems(self, *, model_type: str, num_heads: int, num_kv_heads: int,
                       intermediate_size: int | None) -> list[str]:
        """Tensor parallelism splits attention heads, kv-heads and MLP columns evenly across tp ranks."""
        sizes = {"num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
                 "intermediate_size": intermediate_size}
        return [f"backend.tp={self.tp} must divide the model's {name}={value} ({model_type}; "
                f"{_degrees(self.dp_replicate, self.dp_shard, self.tp, self.sp, self.pp)}, "
                f"world size {self.world_size}); "
                f"pick a tp among {_divisors_of_all([v for v in sizes.values() if v])}"
                for name, value in sizes.items() if value and value % self.tp]

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in (PP_DIM, *DIMS) if name in DIMS or self.pp > 1}

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_dim_names(self) -> tuple[str, ...]:
        """What fully_shard shards over: dp_dim_names, with sp folded into dp_shard (sp peers hold the same weights
        and sum their gradients, as dp peers do)."""
        if self.sp == 1:
            return self.dp_dim_names
        return ("dp_replicate", "dp_shard_sp") if self.dp_replicate > 1 else ("dp_shard_sp",)

    @property
    def dp_dim_names(self) -> tuple[str, ...]:
        """The mesh dims fully_shard gets: ("dp_shard",) for FSDP, ("dp_replicate", "dp_shard") for HSDP."""
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    def data_parallel(self, rank: int) -> tuple[int, int, object]:
        """(dp_rank, dp_size, dp_group) of this rank: which examples it reads, among how many ranks, and the group
        its loss and token sums are reduced over. Every rank its own data (no tp, no replicas): the world (group
        None), no mesh needed; otherwise the "dp" mesh. With sp the sums are reduced over the sp peers too (each
        holds other tokens of the same rows): the "loss" group (`loss_group`)."""
        if self.dp_size == self.world_size and self.dp_replicate == 1:
            return rank, self.world_size, None
        mesh = self.mesh("dp")
        return mesh.get_local_rank(), mesh.size(), self.loss_group() if self.sp > 1 else mesh.get_group()

    def loss_group(self):
        """Ranks whose loss and token sums add up to the global batch's: dp × sp (None: the world, when no tp)."""
        if self.tp == 1:
            return None
        return self.mesh("loss").get_group()

    def sequence_parallel(self) -> tuple[int, int, object]:
        """(sp_rank, sp_size, sp_group): this rank's shard of each row, among how many, and the all-to-all group."""
        if self.sp == 1:
            return 0, 1, None
        mesh = self.mesh("sp")
        return mesh.get_local_rank(), mesh.size(), mesh.get_group()

    def mesh(self, name: str):
        """A device mesh by name, from the world mesh built once: "world"; a dimension ("dp_shard" always,
        "dp_replicate", "tp" and "pp" when > 1); "dp" (ranks that read different data: the sampler's coordinates and
        the loss reduction); "fsdp" (what fully_shard shards over: dp_shard, or (dp_replicate, dp_shard) for
        HSDP; with sp, dp_shard × sp flattened: sp peers hold the same weights); "dp_shard_tp" (with tp: a norm
        partial over both dims is one all-reduce instead of two); with sp, "sp" and "loss" (dp × sp)."""
        if name not in self._meshes:
            self._meshes[name] = self._make_mesh(name)
        return self._meshes[name]

    def _make_mesh(self, name: str):
        if name == "world":
            return self._build_world_mesh()
        world = self.mesh("world")
        names = {"dp": "dp" if self.dp_replicate > 1 else "dp_shard", "fsdp": self.fsdp_dim_names}.get(name, name)
        available = (*world.mesh_dim_names, *(("dp",) if self.dp_replicate > 1 else ()),
                     *(("dp_shard_tp",) if self.tp > 1 else ()), *(("dp_shard_sp", "loss") if self.sp > 1 else ()))
        if any(n not in available for n in ((names,) if isinstance(names, str) else names)):
            raise ValueError(f"no {name!r} mesh in this layout ({self}); meshes: world, fsdp, {', '.join(available)}")
        return world[names]

    def _build_world_mesh(self):
        """Named DeviceMesh, tp innermost; dp_shard is always a dim (size 1 is fine: fully_shard then only keeps its
        DTensor bookkeeping), dp_replicate and tp only when > 1, and the flattened views "dp" (with replicas) and
        "dp_shard_tp" (with tp). A collective: every rank builds it, once."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.device_type is None:
            raise ValueError(f"ParallelDims({self}) has no device type: build it with .on(device_type) for meshes")
        names = (*((PP_DIM,) if self.pp > 1 else ()), *self.dp_dim_names, *(("sp",) if self.sp > 1 else ()),
                 *(("tp",) if self.tp > 1 else ()))
        mesh = init_device_mesh(self.device_type, tuple(getattr(self, n) for n in names), mesh_dim_names=names)
        if self.dp_replicate > 1:
            mesh[self.dp_dim_names]._flatten("dp")
        if self.sp > 1:
            mesh[("dp_shard", "sp")]._flatten("dp_shard_sp")
            mesh[(*self.dp_dim_names, "sp")]._flatten("loss")
        if self.tp > 1:
            mesh[("dp_shard", "tp")]._flatten("dp_shard_tp")
        return mesh

    def __str__(self) -> str:
        stages = f"pp {self.pp} × " if self.pp > 1 else ""
        with_sp = f"sp {self.sp} × " if self.sp != 1 else ""
        return (f"world {self.world_size} = {stages}dp_replicate {self.dp_replicate} × dp_shard {self.dp_shard} × "
                f"{with_sp}tp {self.tp} (data parallel {self.dp_size})")


def _divisors_of_all(values: list[int]) -> list[int]:
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]
