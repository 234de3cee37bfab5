"""DeepSpeed ZeRO-0/1/2/3 with optimizer/parameter offload: the only module that imports deepspeed.

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

import argparse
import contextlib
import copy
import io
import json
import logging
import math
import shutil
from pathlib import Path

import torch

from llmtrain.backends import dims_for
from llmtrain.backends.base import (
    OptimizerSpec,
    autocast_dtype,
    build_scheduler,
    generation_mode,
    has_frozen_params,
    save_frozen,
    save_hf,
)
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

TAG = "ds"  # DeepSpeed's checkpoint tag inside our step folder: checkpoints/step_N/engine/ds/
META = "llmtrain_meta.json"  # stage and dp size a checkpoint was saved with (for resharding)


class DeepSpeedEngine:
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

    # ---- checkpoints ---------------------------------------------------------------------------
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

    def save_checkpoint(self, directory: Path) -> None:
        """All ranks: DeepSpeed writes its own layout (model states, each rank's ZeRO partition) under TAG."""
        if not self.trainable:
            save_frozen(directory, self.model, self.ctx.is_main)
            return
        directory.mkdir(parents=True, exist_ok=True)
        # A frozen base (LoRA) is not saved: resume rebuilds it from its source (backends/base.has_frozen_params).
        self.ds.save_checkpoint(str(directory), tag=TAG, client_state={}, save_latest=True,
                                exclude_frozen_parameters=has_frozen_params(self.model))
        if self.ctx.is_main:
            (directory / META).write_text(json.dumps({"zero_stage": self.stage, "dp_size": self.zero_ranks,
                                                      "precision": self.precision}, indent=1))

    def load_checkpoint(self, directory: Path) -> None:
        """DeepSpeed's loader unpickles its files in full (torch.load(weights_only=False)): load only
        checkpoints you trust. Everything llmtrain itself loads stays weights_only=True."""
        if not self.trainable:
            return  # rebuilt from its source at start: nothing of it changes in training
        if not (directory / META).is_file():
            raise ConfigError(f"resume: {directory} holds no DeepSpeed checkpoint (written by another backend?): "
                              "resume with the backend that wrote it")
        meta = json.loads((directory / META).read_text())
        if meta["dp_size"] != self.zero_ranks or meta["zero_stage"] != self.stage:
            self._load_resharded(directory, meta)
            return
        path, _ = self.ds.load_checkpoint(str(directory), tag=TAG, load_module_strict=not has_frozen_params(self.model),
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{directory}: DeepSpeed found no checkpoint with tag {TAG}")
        self._after_load()

    def _after_load(self, group_settings: list[dict] | None = None) -> None:
        """Undo what DeepSpeed's loaders get wrong for us. ZeRO-1/2 restore the checkpoint's clipping
        threshold (optim.max_grad_norm wins, as under DDP). ZeRO-3's universal loader gives every param
        group group 0's settings (weight decay on norms and biases: `group_settings` puts ours back) and one
        shared `step` tensor to every partition, which torch's AdamW then increments once per partition."""
        if hasattr(self.ds.optimizer, "clip_grad"):
            self.ds.optimizer.clip_grad = self.optim_spec.max_grad_norm
        for group, settings in zip(self.optimizer.param_groups, group_settings or []):
            group.update(settings)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        self._replay_cpu_adam_bias_correction()

    def _replay_cpu_adam_bias_correction(self) -> None:
        """DeepSpeedCPUAdam keeps beta^t in C++ as a running product (× beta each step) but recomputes it with
        pow(beta, t) when the step jumps, as in a resumed run: a last-bit difference that breaks bitwise
        resume. Replaying steps 1..t on empty tensors rebuilds the product the uninterrupted run has."""
        adam = self.optimizer
        steps = [st["step"] for st in adam.state.values() if "step" in st] if hasattr(adam, "ds_opt_adam") else []
        if not steps:
            return
        group, empty = adam.param_groups[0], torch.empty(0)
        beta1, beta2 = group["betas"]
        for step in range(1, int(max(steps)) + 1):
            adam.ds_opt_adam.adam_update(adam.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                         group["weight_decay"], group["bias_correction"], empty, empty, empty, empty)

    def _load_resharded(self, directory: Path, meta: dict) -> None:
        """Another dp size (or ZeRO stage): rank 0 converts the checkpoint to DeepSpeed's universal format
        (per-parameter fp32 weights + Adam moments, no partitioning) and every rank loads its new partition
        from it. Weights, Adam moments and step counts, the lr schedule survive; see the README."""
        if meta["zero_stage"] == 0 and self.stage == 0:  # ZeRO-0 checkpoints hold everything whole: no conversion
            self.ds.load_checkpoint(str(directory), tag=TAG)
            self._after_load()
            return
        if any(group.get("muon") for group in self.optimizer.param_groups):
            raise ConfigError(
                f"resume: {directory} was saved with ZeRO-{meta['zero_stage']} on {meta['dp_size']} ranks, this run is "
                f"ZeRO-{self.stage} on {self.zero_ranks}, and optim=muon: DeepSpeed's universal checkpoint (how ZeRO "
                "reshards) carries Adam's moments only, not Muon's momentum; resume on the same ranks and stage, or "
                "with backend=fsdp2 (its checkpoints reshard with Muon), or from the Hugging Face export")
        if meta["zero_stage"] != self.stage and {meta["zero_stage"], self.stage} != {1, 2} or self.stage == 0:
            raise ConfigError(
                f"resume: {directory} was saved with ZeRO-{meta['zero_stage']} on {meta['dp_size']} ranks, this run "
                f"is ZeRO-{self.stage} on {self.zero_ranks}: a DeepSpeed checkpoint changes dp size within ZeRO-1/2/3 "
                "and stage between 1 and 2 only; keep backend.zero_stage, or start a new run from a Hugging Face "
                "export (model.name_or_path=RUN/hf, written when a run ends)")
        from deepspeed.checkpoint.ds_to_universal import main as to_universal

        root = Path(self.settings.output_dir or directory.parent) / ".universal_tmp"
        log.warning("resume: %s was saved with ZeRO-%d on %d dp ranks, this run is ZeRO-%d on %d: converting it to a "
                    "DeepSpeed universal checkpoint in %s", directory, meta["zero_stage"], meta["dp_size"], self.stage,
                    self.zero_ranks, root)
        if self.ctx.is_main:
            shutil.rmtree(root, ignore_errors=True)
            args = argparse.Namespace(input_folder=str(directory / TAG), output_folder=str(root / TAG),
                                      num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                      strict=True, inject_missing_state=True)  # plain models carry no UC info
            with contextlib.redirect_stdout(io.StringIO()):  # it prints a progress line per parameter
                to_universal(args)
        barrier()
        group_settings = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                          for g in self.optimizer.param_groups]
        # Set at load time: we only learn here that the checkpoint needs the universal loader.
        self.ds._config.load_universal_checkpoint = True
        try:
            path, _ = self.ds.load_checkpoint(str(root), tag=TAG)
        finally:
            self.ds._config.load_universal_checkpoint = False
        barrier()
        if self.ctx.is_main:
            shutil.rmtree(root, ignore_errors=True)
        if path is None:
            raise FileNotFoundError(f"{directory}: the universal checkpoint made from it did not load")
        self._after_load(group_settings)

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
