"""PyTorch DDP: fp32 master weights on every rank, gradients all-reduced (averaged) in backward.

A world of one trains the bare model: DDP there would only copy gradients into buckets and all-reduce
them over a group of one.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from llmtrain import checkpoint_async
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
    trainable_state_dict,
)
from llmtrain.checkpoint_async import host_copy, in_background
from llmtrain.distributed import DistContext
from llmtrain.optim.build import build_optimizer
from llmtrain.parallel import ParallelDims


def load_file(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def load_trainable(model: torch.nn.Module, state: dict) -> None:
    """A checkpoint's weights into the model. With a frozen base (LoRA) the checkpoint holds the trainable
    parameters only (the base was rebuilt from its source at start): exactly those keys, nothing missing."""
    if not has_frozen_params(model):
        model.load_state_dict(state)
        return
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(state) != expected:
        raise ValueError(f"checkpoint has {len(state)} tensors, the model {len(expected)} trainable parameters; "
                         f"missing {sorted(expected - set(state))[:3]}, unexpected {sorted(set(state) - expected)[:3]}")
    model.load_state_dict(state, strict=False)


class DDPEngine(ScaledOptimizerSteps):
    def __init__(self, model: torch.nn.Module, optim: OptimizerSpec | None, ctx: DistContext, precision: str,
                 dims: ParallelDims):
        self.ctx = ctx
        self.dp_rank, self.dp_size, self.dp_group = dims.data_parallel(ctx.rank)
        self.sp_rank, self.sp_size, self.sp_group = 0, 1, None  # no sequence parallelism (backend.sp: not a field)
        self.model = model.to(ctx.device)
        self.optim_spec = optim
        self.compute_dtype = autocast_dtype(precision)
        if optim is None:
            self.model.requires_grad_(False).eval()
            self.module = self.model
            self.optimizer = self.scheduler = None
        else:
            self.module = self._wrap_ddp(self.model) if ctx.world_size > 1 else self.model
            self.optimizer = build_optimizer(self.model, optim, fused=ctx.device.type == "cuda")
            self.scheduler = build_scheduler(self.optimizer, optim)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=precision == "fp16")

    def _wrap_ddp(self, model: torch.nn.Module) -> DistributedDataParallel:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # forward_sync_buffers=False: HF models hold no buffers that change in training (rotary tables are
        # constants), synced once at init. gradient_as_bucket_view: .grad are views into the all-reduce
        # buckets, not a second copy of every gradient (4M bytes fp32 per rank).
        return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False,
                                       gradient_as_bucket_view=True)

    def no_sync(self, is_last_micro_batch: bool):
        """Skip the gradient all-reduce on all but the last micro-batch of a step (a world of one has none)."""
        if is_last_micro_batch or self.module is self.model:
            return contextlib.nullcontext()
        return self.module.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        # DDP averages gradients over ranks; the loss is this rank's share of a global *sum*-based mean.
        self.scaler.scale(loss * self.ctx.world_size).backward()

    def clip_or_fused_step(self) -> torch.Tensor:
        """Global gradient norm before clipping (clips in place when optim.max_grad_norm > 0); the update
        itself happens in step()."""
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        self._measure_after_step([p.grad for p in params])
        max_norm = self.optim_spec.max_grad_norm
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    def generation_context(self):
        return generation_mode(self.model)  # the replicated model, outside DDP's wrapper: no collective

    def save_checkpoint(self, directory: Path) -> None:
        checkpoint_async.write_files(directory, self._checkpoint_files(directory, copy=lambda state: state))

    def save_checkpoint_async(self, directory: Path, group) -> list[Future]:
        """Rank 0 copies the weights and optimizer state to host memory now and writes them on a thread (the
        returned future). `group`: unused (no collective)."""
        staged = self._checkpoint_files(directory, copy=host_copy)
        return [in_background(partial(checkpoint_async.write_files, directory, staged))] if staged else []

    def _checkpoint_files(self, directory: Path, copy) -> dict:
        """Writes what is small now (a frozen role's pointer; rank 0: scheduler, scaler); returns rank 0's large
        files (name -> state passed through `copy`), empty on other ranks."""
        if not self.trainable:
            save_frozen(directory, self.model, self.ctx.is_main)
            return {}
        if not self.ctx.is_main:
            return {}
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
        if self.scaler.is_enabled():
            torch.save(self.scaler.state_dict(), directory / "scaler.pt")
        return {"model.pt": copy(trainable_state_dict(self.model)),  # LoRA: the adapters only
                "optimizer.pt": copy(self.optimizer.state_dict())}

    def load_checkpoint(self, directory: Path) -> None:
        if not self.trainable:
            return  # rebuilt from its source at start: nothing of it changes in training
        load_trainable(self.model, load_file(directory / "model.pt"))
        self.optimizer.load_state_dict(load_file(directory / "optimizer.pt"))
        self.scheduler.load_state_dict(load_file(directory / "scheduler.pt"))
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(load_file(directory / "scaler.pt"))

    def export_hf(self, directory: Path) -> None:
        if self.ctx.is_main:
            save_hf(self.model, None, directory)


class DDPBackend:
    def __init__(self, ctx: DistContext, precision: str, options: dict | None = None):
        self.ctx, self.precision = ctx, precision  # options: DDP has none but its name
        self.dims = dims_for("ddp", options or {}, ctx)  # the run's one layout: every role's engine reads it

    def model_init_context(self):
        return contextlib.nullcontext()

    def gathered_for_init(self, params):
        return contextlib.nullcontext()

    def wrap(self, model: torch.nn.Module, optim: OptimizerSpec | None) -> DDPEngine:
        return DDPEngine(model, optim, self.ctx, self.precision, self.dims)
