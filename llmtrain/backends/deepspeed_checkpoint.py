"""A DeepSpeed engine's checkpoints: DeepSpeed's own layout under our step folder, loaded as it was saved, or (another
dp size, or ZeRO-1 <-> 2) converted to DeepSpeed's universal checkpoint and loaded from it; and the fix-ups its
loaders need. DeepSpeedEngine (backends/deepspeed.py) inherits it."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import shutil
from pathlib import Path

import torch

from llmtrain.backends.base import has_frozen_params, save_frozen
from llmtrain.config import ConfigError
from llmtrain.distributed import barrier

log = logging.getLogger("llmtrain.backends.deepspeed")  # the engine's: these lines are its report

TAG = "ds"  # DeepSpeed's checkpoint tag inside our step folder: checkpoints/step_N/engine/ds/
META = "llmtrain_meta.json"  # stage and dp size a checkpoint was saved with (for resharding)


class DeepSpeedCheckpoints:
    """Save and load of DeepSpeedEngine: it reads the engine's `ds`, `optimizer`, `optim_spec`, `settings`, `stage`,
    `zero_ranks`, `precision`, `trainable`, `model` and `ctx`."""

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
