"""DeepSpeed ZeRO-0/1/2/3 with optimizer/parameter offload: the only module that imports deepspeed (with its
checkpoints' half, deepspeed_checkpoint.py).

How the trainer's contract maps onto DeepSpeed:
- the config comes from `deepspeed_config.build_ds_config` (one source of truth; written to
  `${output_dir}/deepspeed_config.json`); our AdamW groups and LambdaLR go in as client optimizer and
  scheduler, so the lr of every step is DDP's;
- `no_sync(last)` sets DeepSpeed's accumulation boundary, so one `step()` per optimizer step suffices;
- loss scaling: the trainer's loss is already this rank's share of the global token-weighted mean.
  DeepSpeed would divide it by gradient_accumulation_steps (we pass `scale_wrt_gas=False`) and averages
  gradients over the dp ranks (we multiply by dp size): what reaches the optimizer is the gradient of the
  global mean, exactly as under DDP (the grad-norm parity test proves it);
- DeepSpeed computes the gradient norm, clips and updates in one call, so `clip_or_fused_step()` runs
  DeepSpeed's boundary step (the update) and returns its norm; DeepSpeed refuses an update with non-finite gradients
  itself (its overflow check), and `step()`/`skip_step()` only keep the schedule on the step count.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
from pathlib import Path

import torch

from llmtrain.backends import dims_for
from llmtrain.backends.base import (
    OptimizerSpec,
    autocast_dtype,
    build_scheduler,
    generation_mode,
    save_hf,
)
from llmtrain.backends.deepspeed_checkpoint import DeepSpeedCheckpoints
from llmtrain.backends.deepspeed_config import AUTO, AUTO_SIZED, DeepSpeedSettings, build_ds_config
from llmtrain.backends.deepspeed_memory import measure_model_states, storage_ledger
from llmtrain.backends.deepspeed_ops import build_offload_adam, check_ops, import_deepspeed, warn_stale_build_locks
from llmtrain.config import ConfigError
from llmtrain.distributed import DistContext, barrier
from llmtrain.models.lora import is_peft
from llmtrain.optim.build import build_optimizer
from llmtrain.optim.zero_layout import attach_zero_layouts
from llmtrain.parallel import ParallelDims

log = logging.getLogger(__name__)


class DeepSpeedEngine(DeepSpeedCheckpoints):
    def __init__(self, model: torch.nn.Module, optim: OptimizerSpec | None, ctx: DistContext, precision: str,
                 settings: DeepSpeedSettings, ds_config: dict, dims: ParallelDims):
        deepspeed = import_deepspeed()
        self.ctx, self.precision, self.settings, self.optim_spec = ctx, precision, settings, optim
        self.dp_rank, self.dp_size, self.dp_group = dims.data_parallel(ctx.rank)  # ZeRO partitions over the world
        rows = dims.row_share()
        self.sp_rank, self.sp_size, self.sp_group = rows.rank, rows.size, rows.group
        self.zero_ranks = self.dp_size * self.sp_size  # ZeRO's group: every rank (cp, sp peers hold the same weights)
        self.stage = settings.zero_stage
        self.trainable = optim is not None
        self.skips_nonfinite_grads = precision == "fp16"  # DeepSpeed's dynamic loss scaler skips overflows
        self.optimizer_name = None
        self.optimizer = self.scheduler = None
        self._step_applied = True
        self._measuring, self._grad_peak, self._memory = True, {}, None  # model-state bytes, first step
        if optim is None:
            self._init_frozen(deepspeed, model, ds_config)
            return
        config = dict(ds_config)
        if settings.offload_optimizer.device != "none":
            self.optimizer, self.optimizer_name = build_offload_adam(model, optim)
            if not self.optimizer_name.startswith("DeepSpeedCPUAdam"):
                config["zero_force_ds_cpu_optimizer"] = False
        else:
            self.optimizer = build_optimizer(model, optim)
            self.optimizer_name = type(self.optimizer).__name__
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.ds, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler,
                                                config=config, dist_init_required=False)
        self.module = self.ds  # forward through the engine: ZeRO-3 gathers parameters in its hooks
        self.model = self.ds.module
        attach_zero_layouts(self.ds.optimizer, self.optimizer)  # optim=muon: where its matrices lie in the partitions
        # ZeRO-0 in fp32 runs our optimizer unwrapped: DeepSpeed neither computes the norm nor checks it.
        # (BF16_Optimizer, ZeRO-1 under bf16, sets _global_grad_norm only in its first step: test identity.)
        self._own_norm = self.ds.optimizer is self.optimizer
        if ctx.is_main:
            log.info("DeepSpeed ZeRO-%d on %d ranks, %s, optimizer %s (offload: optimizer %s, params %s)", self.stage,
                     self.zero_ranks, precision, self.optimizer_name, settings.offload_optimizer.device,
                     settings.offload_param.device)

    def _init_frozen(self, deepspeed, model, ds_config) -> None:
        """No optimizer (reference/reward models): ZeRO-3 keeps the weights partitioned, others hold them whole.
        Either way the weights are in the compute dtype, as DeepSpeed holds a trainable model's (bf16/fp16
        working copy): a frozen copy of the policy computes exactly what the policy computes at step 0."""
        model.requires_grad_(False).eval()
        if self.stage == 3:
            self.ds, _, _, _ = deepspeed.initialize(model=model, config=ds_config, dist_init_required=False)
            self.module, self.model = self.ds, self.ds.module
        else:
            self.ds = None
            dtype = autocast_dtype(self.precision) or torch.float32
            self.module = self.model = model.to(self.ctx.device, dtype=dtype)

    # ---- the step ------------------------------------------------------------------------------
    def autocast(self):
        return contextlib.nullcontext()  # bf16/fp16: DeepSpeed casts the model itself

    def no_sync(self, is_last_micro_batch: bool):
        """DeepSpeed reduces (ZeRO-0/1) or finalises (ZeRO-2/3) gradients on the boundary micro-batch only."""
        if self.optimizer is not None:
            self.ds.set_gradient_accumulation_boundary(is_last_micro_batch)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # Undo what DeepSpeed applies: no 1/accumulation (scale_wrt_gas=False), × its ranks (dp × sp) for its average.
        self.ds.backward(loss * self.zero_ranks, scale_wrt_gas=False)
        if self._measuring:  # gradients exist between backward and step: their peak over the micro-batches
            ledger = storage_ledger(self.ds.optimizer, self.model)
            for role in ("grads", "buffers"):
                self._grad_peak[role] = max(self._grad_peak.get(role, 0), ledger.bytes[role])

    def clip_or_fused_step(self) -> torch.Tensor:
        """Run DeepSpeed's boundary step (norm, clip at optim.max_grad_norm, UPDATE, schedule); return the norm
        before clipping. Non-finite gradients: DeepSpeed discards the update (ZeRO-0 fp32: we do)."""
        own = None
        if self._own_norm:
            own = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
            if not math.isfinite(float(own)):
                self.ds.zero_grad()
                self._step_applied = False
                return own
        self.ds.step()
        self._step_applied = self.ds.was_step_applied()
        if self._measuring:
            self._memory = measure_model_states(self.ds, self.model, self.settings, self._grad_peak,
                                                self.zero_ranks, self.ctx.is_main)
            self._measuring = False
        if own is not None:
            return own
        norm = self.ds.get_global_grad_norm()
        return torch.as_tensor(float("inf") if norm is None else norm, dtype=torch.float32).float()

    def _keep_schedule_on_step_count(self) -> None:
        # DeepSpeed does not advance the schedule on a step it skipped; DDP does, so the lr follows the step.
        if not self._step_applied:
            self.scheduler.step()

    def step(self) -> None:
        self._keep_schedule_on_step_count()

    def skip_step(self) -> None:
        if self._step_applied:  # finite gradients but a non-finite loss: the update is already in
            log.warning("DeepSpeed applied this step's update before its loss was found non-finite")
        self._keep_schedule_on_step_count()

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ---- model-state bytes -----------------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, float] | None:
        """Measured after the first optimizer step (None before): params, fp32 master, grads (peak over the
        micro-batches), Adam state, host share, buckets apart; with the adjusted formula next to each."""
        return self._memory

    # ---- generation ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def generation_context(self):
        if self.stage != 3:
            with generation_mode(self.model):
                yield self.model
            return
        if self.optimizer is None:
            raise ValueError("deepspeed ZeRO-3: generation runs on a trainable engine (its hooks live in the "
                             "optimizer)")
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(self.ds), generation_mode(self.model):
            yield self.model

    # ---- export --------------------------------------------------------------------------------
    def export_hf(self, directory: Path) -> None:
        """A consolidated Hugging Face folder from any stage: under bf16/fp16 the fp32 master weights (the
        working copy is rounded to 16 bits), at ZeRO-3 gathered parameter by parameter."""
        masters = self.optimizer is not None and self.precision in ("bf16", "fp16")
        state = self.gathered_state_dict() if self.stage == 3 or masters else None
        if self.ctx.is_main:
            save_hf(self.model, state, directory)
            # save_pretrained writes the module's dtype; from_pretrained's default ("auto") follows it
            if masters and not is_peft(self.model):
                config = copy.deepcopy(self.model.config)
                config.dtype = torch.float32
                config.save_pretrained(directory)
        barrier()

    def gathered_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full weights on rank 0 (None elsewhere); a collective: every rank calls it. With an optimizer these
        are DeepSpeed's fp32 masters (`safe_get_full_fp32_param`: ZeRO-1/2 and BF16_Optimizer all-reduce the
        partitions, ZeRO-3 all-gathers them; ZeRO-0 keeps whole fp32 copies); a frozen engine (no optimizer)
        or a frozen parameter has no master: what the module holds (bf16 under bf16)."""
        deepspeed = import_deepspeed()
        zero0 = self._zero0_masters() if self.optimizer is not None and self.stage == 0 else {}
        state = {}
        for name, param in self.model.named_parameters():
            master = None
            if self.optimizer is not None:
                master = zero0.get(id(param)) if self.stage == 0 else deepspeed.utils.safe_get_full_fp32_param(param)
            if master is not None:
                if self.ctx.is_main:
                    state[name] = master.detach().to("cpu", copy=True).view(param.ds_shape if hasattr(param, "ds_shape")
                                                                             else param.shape)
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if self.ctx.is_main:
                    state[name] = param.detach().to("cpu", copy=True)
        if not self.ctx.is_main:
            return None
        persistent = set(self.model.state_dict())  # keys only: non-persistent buffers (rotary tables) are not saved
        state.update({name: b.detach().to("cpu", copy=True) for name, b in self.model.named_buffers()
                      if name in persistent})
        return state

    def _zero0_masters(self) -> dict[int, torch.Tensor]:
        """ZeRO-0 under bf16/fp16 (DeepSpeed's FP16_UnfusedOptimizer): id(module parameter) -> its fp32 copy."""
        opt = self.ds.optimizer
        return {id(lp): hp for lps, hps in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", []))
                for lp, hp in zip(lps, hps)}


def model_hidden_size(model: torch.nn.Module) -> int | None:
    """The hidden size in the model's config (multimodal configs keep it in text_config); None if absent."""
    config = getattr(model, "config", None)
    for node in (config, getattr(config, "text_config", None)):
        if isinstance(getattr(node, "hidden_size", None), int):
            return node.hidden_size
    return None


class DeepSpeedBackend:
    def __init__(self, ctx: DistContext, precision: str, options: dict | None = None):
        """`options`: cfg.backend as a plain dict plus `run` (micro_batch_size, grad_accum_steps, output_dir)."""
        self.ctx, self.precision = ctx, precision
        self.settings = DeepSpeedSettings.from_options(options or {})
        check_ops(self.settings)  # before the model loads
        if ctx.local_rank == 0:
            warn_stale_build_locks()  # init_distributed below loads an op (on CPU: the shm communicator)
        # DeepSpeed's comm layer wraps the process group llmtrain already started (zero.Init needs it).
        import_deepspeed().init_distributed(dist_init_required=False, verbose=False)
        self.dims = dims_for("deepspeed", options or {}, ctx)  # the run's one layout: every role's engine reads it

    def ds_config(self, max_grad_norm: float, model: torch.nn.Module | None = None) -> dict:
        """`model` sizes the "auto" buckets; None before it exists (zero.Init), where they are left out."""
        hidden = None if model is None else model_hidden_size(model)
        autos = [f"backend.{name}" for name in AUTO_SIZED if getattr(self.settings, name) == AUTO]
        if model is not None and hidden is None and autos:
            raise ConfigError(f"{', '.join(autos)}=auto size DeepSpeed's buckets from the model's hidden_size, which "
                              f"{type(model).__name__}'s config lacks: set them to integers (elements)")
        return build_ds_config(self.settings, dp_size=self.dims.dp_size * self.dims.row_size, precision=self.precision,
                               max_grad_norm=max_grad_norm, hidden_size=hidden)

    def _write_config(self, config: dict) -> None:
        if self.ctx.is_main and self.settings.output_dir:
            out = Path(self.settings.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "deepspeed_config.json").write_text(json.dumps(config, indent=2) + "\n")

    @contextlib.contextmanager
    def model_init_context(self):
        """ZeRO-3: let transformers build the model under deepspeed.zero.Init (via HfDeepSpeedConfig), so
        each rank only ever holds its partition; a 70B never materialises whole on one rank.
        transformers keeps that config in a module global: it is set for this build only and unset after,
        so building one role never changes how the next is built (a ZeRO-2 role after a ZeRO-3 one)."""
        if self.settings.zero_stage != 3:
            yield
            return
        import_deepspeed()
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        hf_ds_config = HfDeepSpeedConfig(self.ds_config(max_grad_norm=0.0))  # held: transformers keeps a weakref
        try:
            yield
        finally:
            unset_hf_deepspeed_config()
            del hf_ds_config

    def gathered_for_init(self, params):
        """ZeRO-3: the parameters whole on every rank while they are written; rank 0's values are kept."""
        if self.settings.zero_stage != 3 or not any(hasattr(p, "ds_id") for p in params):
            return contextlib.nullcontext()
        return import_deepspeed().zero.GatheredParameters(params, modifier_rank=0)

    def wrap(self, model: torch.nn.Module, optim: OptimizerSpec | None) -> DeepSpeedEngine:
        config = self.ds_config(max_grad_norm=optim.max_grad_norm if optim is not None else 0.0, model=model)
        if optim is not None:
            self._write_config(config)
        return DeepSpeedEngine(model, optim, self.ctx, self.precision, self.settings, config, self.dims)
