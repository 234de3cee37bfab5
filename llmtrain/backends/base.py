"""The Backend/Engine seam, and the optimizer pieces every backend shares.

A Backend wraps a model into an Engine (`optim=None`: frozen, no optimizer). The Engine is all the
trainer and the stages see: forward through `engine.module`, `backward(loss)` with the loss already
normalised to this rank's share of the global-batch mean, `clip_grad_norm()`, `step()`.
Each engine knows how its gradient reduction scales the loss (DDP averages over ranks), so the
token normalisation is applied exactly once, whatever the backend.
"""

from __future__ import annotations

import contextlib
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True)
class OptimizerSpec:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    warmup_steps: int
    schedule: str
    min_lr_ratio: float
    max_grad_norm: float  # 0: no clipping
    max_steps: int


class Engine(Protocol):
    module: torch.nn.Module  # call for forward (may be a wrapper)
    model: torch.nn.Module  # the underlying Hugging Face model
    dp_rank: int  # this rank's data-parallel coordinate: which examples it reads
    dp_size: int  # ranks that read different examples (tensor-parallel peers share theirs)
    dp_group: object  # process group over which loss/token sums are reduced (None: the world)
    skips_nonfinite_grads: bool  # True when the engine's loss scaler skips overflowed steps itself

    def autocast(self) -> AbstractContextManager: ...
    def no_sync(self, is_last_micro_batch: bool) -> AbstractContextManager: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    # Global gradient norm before clipping. An engine whose library fuses norm, clip and update in one
    # call (DeepSpeed) applies the update here, never with non-finite gradients; its step()/skip_step()
    # then only keep the lr schedule on the step count. The trainer reads current_lr() before this call.
    def clip_grad_norm(self) -> torch.Tensor: ...
    def step(self) -> None: ...
    def skip_step(self) -> None: ...
    def current_lr(self) -> float: ...
    def save_checkpoint(self, directory: Path) -> None: ...
    def load_checkpoint(self, directory: Path) -> None: ...
    def export_hf(self, directory: Path) -> None: ...


class Backend(Protocol):
    # Entered around model construction: DeepSpeed ZeRO-3 builds the model under deepspeed.zero.Init so
    # no rank ever holds the whole model; FSDP2 builds it on the meta device on ranks other than 0 (wrap()
    # fills their shards from rank 0); DDP needs nothing (nullcontext).
    def model_init_context(self) -> AbstractContextManager: ...
    def wrap(self, model: torch.nn.Module, optim: OptimizerSpec | None) -> Engine: ...


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index `step`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices (weights, embeddings), none on biases and norm scales (ndim < 2)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3: the data is a 1-D shard, ds_shape the full
            (decay if len(shape) >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: torch.nn.Module, spec: OptimizerSpec, fused: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=spec.betas,
                             eps=spec.eps, fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> torch.optim.lr_scheduler.LRScheduler:
    factor = partial(lr_factor, warmup_steps=spec.warmup_steps, max_steps=spec.max_steps,
                     schedule=spec.schedule, min_lr_ratio=spec.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(step))


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


class ScaledOptimizerSteps:
    """autocast / step / skip_step / current_lr for engines that own a torch `optimizer`, `scheduler`,
    a (possibly disabled) GradScaler `scaler`, `compute_dtype` and `ctx` (DDP, FSDP2)."""

    @property
    def skips_nonfinite_grads(self) -> bool:
        """fp16: the loss scaler skips overflowed steps itself (that is how it finds its scale)."""
        return self.scaler.is_enabled()

    def autocast(self) -> AbstractContextManager:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.compute_dtype)

    def step(self) -> None:
        self.scaler.step(self.optimizer)  # fp16: skipped by the scaler when gradients overflowed
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """Discard this step's gradients; the schedule still advances so the lr follows the step count."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update()
        self.scheduler.step()

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]
