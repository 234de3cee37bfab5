"""FSDP2 (`fully_shard`) on a named DeviceMesh, with optional tensor parallelism: dp × tp, and HSDP.

The model goes onto the mesh in backends/fsdp2_parallelize.py: `parallelize()` (tp, ep, compile, fully_shard, in
that order, and why), and on ranks that built it on the meta device its weights from rank 0.

Loss scaling: FSDP2 *averages* gradients over the dp ranks (reduce-scatter over dp_shard, all-reduce
over dp_replicate); the trainer's loss is this rank's share of the global token-weighted mean, so
`backward` multiplies by dp_size, as DDP multiplies by its world size. TP peers see the same examples
and TP's own collectives are exact sums, so tp does not enter the scale. The grad-norm parity test
catches any sum-vs-average error (upstream reported FSDP2 on gloo summing in some versions; in torch
2.13 it averages, which that test checks).
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from llmtrain.backends import dims_for
from llmtrain.backends.base import (
    OptimizerSpec,
    ScaledOptimizerSteps,
    autocast_dtype,
    build_scheduler,
    generation_mode,
    has_frozen_params,
    save_frozen,
    save_hf,
)
from llmtrain.backends.fsdp2_parallelize import load_from_rank0, parallelize, ranks_on_meta, set_aside_and_empty
from llmtrain.distributed import DistContext
from llmtrain.optim.build import build_optimizer
from llmtrain.parallel import ParallelDims

log = logging.getLogger(__name__)

# Optimizer state keyed by parameter name, one entry per parameter: a checkpoint loads into any
# mesh and any grouping of parameters (resharding dp=2 -> dp=2 × tp=2 changes both).
DCP_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# ---- DTensor-aware gradient norm ----------------------------------------------------------------

def _by_mesh(tensors: list[torch.Tensor]) -> dict:
    """With TP, Linear weights live on the (dp, tp) mesh and the rest on the dp mesh; DTensor ops
    (foreach norm, foreach mul, fused Adam) refuse to mix meshes, so each mesh is handled apart."""
    groups = defaultdict(list)
    for t in tensors:
        groups[t.device_mesh if isinstance(t, DTensor) else None].append(t)
    return groups


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient: per mesh a DTensor norm made whole with
    full_tensor() (an all-reduce of squared partial norms), then combined; the same value on every rank."""
    norms = []
    for group in _by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def clip_to_norm(model: torch.nn.Module, max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient so their total norm `norm` (measured once, over every mesh) becomes at most max_norm
    (0: no clipping); clip_grads_with_norm_ works on one mesh's DTensors at a time."""
    if max_norm > 0:
        params = [p for p in model.parameters() if p.grad is not None]
        for group in _by_mesh(params).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)


def split_groups_by_mesh(groups: list[dict]) -> list[dict]:
    """AdamW groups (decay / no decay) split further so no group mixes DTensor meshes."""
    return [{**group, "params": params} for group in groups
            for params in _by_mesh(group["params"]).values()]


# ---- the engine ---------------------------------------------------------------------------------

class FSDP2Engine(ScaledOptimizerSteps):
    def __init__(self, model: torch.nn.Module, optim: OptimizerSpec | None, ctx: DistContext, precision: str,
                 dims: ParallelDims, *, reshard_after_forward: bool = True, cpu_offload: bool = False,
                 compile: bool = False):
        self.ctx, self.dims, self.optim_spec = ctx, dims, optim
        self.reshard_after_forward = reshard_after_forward
        data_mesh = dims.mesh("dp")  # ranks that read different data (tp peers share theirs)
        self.dp_rank, self.dp_size, self.dp_group = data_mesh.get_local_rank(), data_mesh.size(), data_mesh.get_group()
        rows = dims.row_share()
        self.sp_rank, self.sp_size, self.sp_group = rows.rank, rows.size, rows.group
        if self.sp_size > 1:  # sp peers hold other tokens of the same rows: their sums add up too
            self.dp_group = dims.loss_group()
        # GPU + bf16: FSDP keeps fp32 shards (the optimizer's master weights), all-gathers bf16 copies
        # for compute and reduces gradients in fp32. Elsewhere (CPU, fp16) plain autocast, as in DDP.
        self.mixed_precision = ctx.device.type == "cuda" and precision == "bf16"
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.mixed_precision else MixedPrecisionPolicy()
        self.compute_dtype = None if self.mixed_precision else autocast_dtype(precision)
        if cpu_offload and ctx.device.type != "cuda":
            log.warning("backend.cpu_offload=true does nothing on %s: the shards are in host memory already",
                        ctx.device.type)
            cpu_offload = False  # CPUOffloadPolicy pins memory, which needs an accelerator
        if optim is None:
            model.requires_grad_(False).eval()
        on_meta = ranks_on_meta(model) if ctx.world_size > 1 else []
        if 0 in on_meta:
            raise ValueError("fsdp2: rank 0 built the model on the meta device, but the other ranks load their "
                             "weights from rank 0's copy")
        rank0_weights = set_aside_and_empty(model) if on_meta and ctx.is_main else None
        parallelize(model, dims, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(), compile=compile)
        if on_meta:
            load_from_rank0(model, rank0_weights, ctx.device, cpu_offload=cpu_offload)
            del rank0_weights  # rank 0's full copy goes now
            if ctx.is_main:
                log.info("fsdp2: rank%s %s built the model on meta, weights from rank 0",
                         "s" if len(on_meta) > 1 else "", ", ".join(map(str, on_meta)))
        self.model = self.module = model
        self.optimizer = self.scheduler = None
        if optim is not None:
            fused = ctx.device.type == "cuda" and not cpu_offload
            self.optimizer = build_optimizer(model, optim, fused=fused, split=split_groups_by_mesh)
            self.scheduler = build_scheduler(self.optimizer, optim)
        if precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # all-reduces found_inf
            self.scaler = ShardedGradScaler(ctx.device.type, enabled=True)
        else:
            self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)

    @contextlib.contextmanager
    def no_sync(self, is_last_micro_batch: bool):
        """Accumulate unsharded gradients locally on all but the last micro-batch (no reduce-scatter),
        and keep the parameters gathered after those backwards (no re-all-gather in the next forward)."""
        if self.optimizer is not None:
            self.model.set_requires_gradient_sync(is_last_micro_batch)
            self.model.set_reshard_after_backward(is_last_micro_batch)
        yield

    def backward(self, loss: torch.Tensor) -> None:
        # FSDP averages over its shard mesh, dp × sp ranks: undo it (docstring)
        self.scaler.scale(loss * (self.dp_size * self.sp_size)).backward()

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def clip_or_fused_step(self) -> torch.Tensor:
        """Global gradient norm before clipping (clips in place when optim.max_grad_norm > 0); the update
        itself happens in step()."""
        self.scaler.unscale_(self.optimizer)
        self._measure_after_step(self._grads())
        norm = total_grad_norm(self._grads())
        clip_to_norm(self.model, self.optim_spec.max_grad_norm, norm)
        return norm

    # ---- checkpoints: torch.distributed.checkpoint, one shard file per rank ------------------------
    def _dcp_options(self) -> StateDictOptions:
        """With a frozen base (LoRA) only the trainable shards are saved and loaded: resume rebuilds the base
        from its source (backends/base.has_frozen_params)."""
        if not has_frozen_params(self.model):
            return DCP_OPTIONS
        return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)

    @contextlib.contextmanager
    def generation_context(self):
        """Every FSDP unit unsharded once (one all-gather each) and kept so through the block; then resharded, with
        each unit's reshard-after-forward as parallelize set it."""
        # peft's generate() runs the wrapped model's forward, below the root (the PeftModel): a unit whose forward
        # runs before the root's would make itself a root, and the root's next forward fail. Settle the roots first.
        fully_shard.state(self.model)._lazy_init()
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        self.model.set_reshard_after_forward(False)
        for unit in units:
            unit.unshard()
        try:
            with generation_mode(self.model):
                yield self.model
        finally:
            self.model.set_reshard_after_forward(self.reshard_after_forward)
            self.model.set_reshard_after_forward(False, recurse=False)  # the root never reshards (apply_fsdp)
            for unit in units:
                unit.reshard()

    def save_checkpoint(self, directory: Path) -> None:
        """Sharded model + optimizer (DCP, loads into any mesh) and, from rank 0, scheduler/scaler."""
        if not self.trainable:
            save_frozen(directory, self.model, self.ctx.is_main)
            return
        directory.mkdir(parents=True, exist_ok=True)
        dcp.save(self._dcp_state(), checkpoint_id=directory / "dcp")
        self._save_scheduler(directory)

    def save_checkpoint_async(self, directory: Path, group) -> list[Future]:
        """As save_checkpoint, the shards through `dcp.async_save`: copied to host memory before it returns, written
        by its thread, whose collectives run on `group` (checkpoint_async.checkpoint_group)."""
        if not self.trainable:
            save_frozen(directory, self.model, self.ctx.is_main)
            return []
        directory.mkdir(parents=True, exist_ok=True)
        write = dcp.async_save(self._dcp_state(), checkpoint_id=directory / "dcp", process_group=group)
        self._save_scheduler(directory)
        return [write]

    def _dcp_state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer or (), options=self._dcp_options())
        return {"model": model_sd, "optimizer": optim_sd}

    def _save_scheduler(self, directory: Path) -> None:
        if self.ctx.is_main and self.scheduler is not None:
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
            if self.scaler.is_enabled():
                torch.save(self.scaler.state_dict(), directory / "scaler.pt")

    def load_checkpoint(self, directory: Path) -> None:
        if not self.trainable:
            return  # rebuilt from its source at start: nothing of it changes in training
        if not (directory / "dcp").is_dir():
            raise FileNotFoundError(f"{directory} holds no FSDP2 checkpoint (dcp/): it was saved by another "
                                    "backend; resume with that backend or start from its Hugging Face export")
        options = self._dcp_options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=directory / "dcp")  # in place, resharded to this mesh
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)
        self._load_scheduler(directory)

    def _load_scheduler(self, directory: Path) -> None:
        scheduler = torch.load(directory / "scheduler.pt", map_location="cpu", weights_only=True)
        # The lr lambda is the same for every group, but the number of groups follows the mesh: each group's own
        # peak lr (optim=muon: Muon's may differ from AdamW's) and, loaded with the optimizer, its current lr.
        groups = self.optimizer.param_groups
        scheduler["base_lrs"] = [group["initial_lr"] for group in groups]
        scheduler["_last_lr"] = [group["lr"] for group in groups]
        self.scheduler.load_state_dict(scheduler)
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(torch.load(directory / "scaler.pt", map_location="cpu", weights_only=True))

    def export_hf(self, directory: Path) -> None:
        """A consolidated Hugging Face folder: full tensors gathered to rank 0 (on the CPU), saved there."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # (dp, tp) weights gather in two all-gathers; DTensor warns about it once per rank, but gathers
        # are exact copies (no reduction order), and this runs once per export.
        redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
        level = redistribute_log.level
        redistribute_log.setLevel(logging.ERROR)
        try:
            state = get_model_state_dict(self.model, options=options)  # a collective: every rank calls it
        finally:
            redistribute_log.setLevel(level)
        if self.ctx.is_main:
            # transformers strips the "FSDP" class prefix from config.architectures itself
            save_hf(self.model, state, directory)


class FSDP2Backend:
    def __init__(self, ctx: DistContext, precision: str, options: dict | None = None):
        options = options or {}
        self.ctx, self.precision = ctx, precision
        self.dims = dims_for("fsdp2", options, ctx)  # the run's one layout: every role's engine reads its meshes
        self.dims.mesh("world")  # built now, once (a collective on every rank), not inside the first role's wrap
        self.settings = {k: options[k] for k in ("reshard_after_forward", "cpu_offload", "compile") if k in options}

    def model_init_context(self):
        """Rank 0 builds the whole fp32 model; the others build it on the meta device (no storage, no
        weights read) and receive their shards from rank 0 in wrap() (see backends/fsdp2_parallelize.py)."""
        return contextlib.nullcontext() if self.ctx.is_main else torch.device("meta")

    def wrap(self, model: torch.nn.Module, optim: OptimizerSpec | None) -> FSDP2Engine:
        return FSDP2Engine(model, optim, self.ctx, self.precision, self.dims, **self.settings)

    def gathered_for_init(self, params):
        return contextlib.nullcontext()  # rank 0 holds the whole model at init; the others are on meta
