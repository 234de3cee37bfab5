"""The Backend/Engine seam, and the optimizer pieces every backend shares.

A Backend wraps a model into an Engine (`optim=None`: frozen, no optimizer). The Engine is all the
trainer and the stages see: forward through `engine.module`, `backward(loss)` with the loss already
normalised to this rank's share of the global-batch mean, `clip_or_fused_step()`, `step()`.
Every role of a run is wrapped by the same Backend: one ParallelDims, one device mesh, the same
data-parallel coordinates for every role.
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
from typing import TYPE_CHECKING, Protocol

import torch

from llmtrain.optim.spec import MuonSpec

if TYPE_CHECKING:
    from llmtrain.distributed import DistContext
    from llmtrain.parallel import ParallelDims


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
    muon: MuonSpec | None = None  # optim.name=muon: Muon for the hidden matrices (llmtrain/optim)


class Engine(Protocol):
    ctx: DistContext  # rank, world size, device
    module: torch.nn.Module  # call for forward (may be a wrapper)
    model: torch.nn.Module  # the underlying Hugging Face model
    trainable: bool  # False: wrapped with optim=None (no optimizer, no gradients, nothing checkpointed)
    dp_rank: int  # this rank's data-parallel coordinate: which examples it reads
    dp_size: int  # ranks that read different examples (tensor-parallel peers share theirs)
    dp_group: object  # process group over which loss/token sums are reduced (None: the world): dp × sp ranks
    sp_rank: int  # this rank's sequence shard of each row (models/ulysses.py); 0 without sp
    sp_size: int  # ranks that share each row (backend.sp); gradients are summed over dp × sp ranks
    sp_group: object  # the sp peers' all-to-all group (None without sp)
    skips_nonfinite_grads: bool  # True when the engine's loss scaler skips overflowed steps itself

    def autocast(self) -> AbstractContextManager: ...
    def no_sync(self, is_last_micro_batch: bool) -> AbstractContextManager: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    # Returns the global gradient norm before clipping, and clips. An engine whose library fuses norm, clip
    # and update in one call (DeepSpeed) APPLIES THE UPDATE here, never with non-finite gradients; its
    # step()/skip_step() then only keep the lr schedule on the step count. Others update in step().
    # Read current_lr() before this call.
    def clip_or_fused_step(self) -> torch.Tensor: ...
    def step(self) -> None: ...
    def skip_step(self) -> None: ...
    def current_lr(self) -> float: ...
    # Bytes this rank holds for the model's states (params, grads, optimizer...), measured during the
    # first optimizer step; None before that (and always for a frozen engine: its params are in the plan).
    def model_state_bytes(self) -> dict[str, float] | None: ...
    def save_checkpoint(self, directory: Path) -> None: ...
    def load_checkpoint(self, directory: Path) -> None: ...
    def export_hf(self, directory: Path) -> None: ...
    # The Hugging Face model, whole on this rank, for `generate` (a trainable engine's): ZeRO-3 gathers the
    # weights once and removes its hooks for the block (re-registered after, or the next step fails); FSDP2
    # unshards every unit once and keeps it unsharded through the block. So the many small forwards of a
    # generation run no collective: ranks that stop at different lengths cannot hang one another.
    def generation_context(self) -> AbstractContextManager[torch.nn.Module]: ...


class Backend(Protocol):
    dims: ParallelDims  # the run's layout, shared by every role this backend wraps

    # Entered around model construction: DeepSpeed ZeRO-3 builds the model under deepspeed.zero.Init so
    # no rank ever holds the whole model (scoped: the next role is built as its own context says); FSDP2
    # builds it on the meta device on ranks other than 0 (wrap() fills their shards from rank 0); DDP
    # needs nothing (nullcontext).
    def model_init_context(self) -> AbstractContextManager: ...
    # Around writing the given parameters at init (seeded init of a module): ZeRO-3 gathers them whole and
    # partitions rank 0's values again afterwards; elsewhere nothing.
    def gathered_for_init(self, params: list[torch.nn.Parameter]) -> AbstractContextManager: ...
    def wrap(self, model: torch.nn.Module, optim: OptimizerSpec | None) -> Engine: ...


def local_state_bytes(params: list[torch.Tensor], grads: list[torch.Tensor], optimizer) -> dict[str, float]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards of DTensors only)."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    optim_bytes = 0
    if optimizer is not None:
        optim_bytes = sum(local(v) for state in optimizer.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor) and v.ndim > 0)  # skip the scalar step counts
    return {"params": float(sum(local(p) for p in params)), "grads": float(sum(local(g) for g in grads)),
            "optimizer": float(optim_bytes)}


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
    from llmtrain.optim.build import adamw_groups

    return adamw_groups(list(model.parameters()), weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> torch.optim.lr_scheduler.LRScheduler:
    factor = partial(lr_factor, warmup_steps=spec.warmup_steps, max_steps=spec.max_steps,
                     schedule=spec.schedule, min_lr_ratio=spec.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(step))


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


class ScaledOptimizerSteps:
    """autocast / step / skip_step / current_lr / model_state_bytes for engines that own a torch
    `optimizer` (None: frozen), `scheduler`, a (possibly disabled) GradScaler `scaler`, `compute_dtype`
    and `ctx` (DDP, FSDP2)."""

    _state_bytes: dict[str, float] | None = None
    _grad_bytes: float = 0.0

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

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
        self._measure_optimizer()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """Discard this step's gradients; the schedule still advances so the lr follows the step count."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update()
        self.scheduler.step()

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def model_state_bytes(self) -> dict[str, float] | None:
        return self._state_bytes

    def _measure_after_step(self, grads: list[torch.Tensor]) -> None:
        """Once, at the first optimizer step: gradients are read before the update clears them."""
        if self._state_bytes is None and self.optimizer is not None:
            self._grad_bytes = local_state_bytes([], grads, None)["grads"]

    def _measure_optimizer(self) -> None:
        if self._state_bytes is None and self.optimizer is not None and self.optimizer.state:
            self._state_bytes = {**local_state_bytes(list(self.model.parameters()), [], self.optimizer),
                                 "grads": self._grad_bytes}


@contextlib.contextmanager
def generation_mode(model: torch.nn.Module):
    """Eval mode (no dropout) with the KV cache on (models are built with use_cache=False for training);
    both restored after."""
    was_training, use_cache = model.training, model.config.use_cache
    model.eval()
    model.config.use_cache = True
    try:
        yield model
    finally:
        model.config.use_cache = use_cache
        model.train(was_training)


def has_frozen_params(model: torch.nn.Module) -> bool:
    """True when part of a trainable model is frozen (peft=lora: the base); its checkpoints then hold only
    the trainable parameters, and resume rebuilds the rest from the model's source (model.name_or_path or the
    seeded init), exactly as a frozen role is rebuilt."""
    return any(not p.requires_grad for p in model.parameters())


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint of a trainable model holds: everything, or with a frozen base its trainable params."""
    if not has_frozen_params(model):
        return model.state_dict()
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def save_hf(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, directory: Path) -> None:
    """A Hugging Face folder from the full (gathered) state dict (None: the model's own, when it is whole).
    A peft model writes the merged weights there and its adapters in peft format next to it (`adapter/`)."""
    from llmtrain.models.lora import adapter_dir_for, is_peft, save_adapter_and_merged, unwrap_peft

    with cache_on_for_export(unwrap_peft(model)):
        if is_peft(model):
            save_adapter_and_merged(model, model.state_dict() if state is None else state, directory,
                                    adapter_dir_for(directory))
        else:
            model.save_pretrained(directory, state_dict=state, safe_serialization=True)


@contextlib.contextmanager
def cache_on_for_export(model: torch.nn.Module):
    """Training builds models with use_cache=False; an export written so would make every later `generate()` on it
    run without a KV cache (several times slower; TRL's GRPOTrainer picks it up from generation_config.json)."""
    generation = getattr(model, "generation_config", None)
    saved = model.config.use_cache, getattr(generation, "use_cache", None)
    model.config.use_cache = True
    if generation is not None:
        generation.use_cache = True
    try:
        yield
    finally:
        model.config.use_cache = saved[0]
        if generation is not None:
            generation.use_cache = saved[1]


FROZEN_MARKER = "frozen.json"


def save_frozen(directory: Path, model: torch.nn.Module, is_main: bool) -> None:
    """A frozen role's checkpoint is a pointer to where its weights come from: they never change."""
    if is_main:
        import json

        directory.mkdir(parents=True, exist_ok=True)
        source = getattr(getattr(model, "config", None), "_name_or_path", "") or "model.from_config (seeded init)"
        (directory / FROZEN_MARKER).write_text(json.dumps({"frozen": True, "source": str(source)}, indent=1))
