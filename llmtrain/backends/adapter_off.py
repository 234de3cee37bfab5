"""A frozen role that is a trainable role's model with its LoRA adapters switched off (peft=lora).

DPO's reference (and PPO's) is the initial policy. With LoRA the initial policy is the frozen base, which the
policy's model already holds: the reference is that same model run inside peft's `disable_adapter()`, so no
second copy of the base is built, sharded or kept in memory. Backend-agnostic: it only wraps the target role's
Engine (DDP, DeepSpeed, FSDP2), whose `.model` is the PeftModel under any wrapper and whose `.module` is what
the policy's own forward calls (ZeRO-3 gathers and FSDP2 unshards in hooks there).

The forward runs in eval mode (a frozen engine's mode: no dropout), under no_grad, and puts the target's mode
back after. peft's dropout acts on the adapter path only, which is off here, but the policy's forward has it:
config.py refuses peft.dropout > 0 for stages with such a reference, so the first ratio is exactly 1.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from llmtrain.backends.base import FROZEN_MARKER

log = logging.getLogger(__name__)


class AdapterOffForward:
    """`engine.module` of the view: call it as the target's module; `.eval()`/`.train()` change nothing
    (the view's forward always runs in eval mode)."""

    def __init__(self, target):
        self.target = target

    def __call__(self, *args, **kwargs):
        model = self.target.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), model.disable_adapter():
                return self.target.module(*args, **kwargs)
        finally:
            model.train(was_training)

    def eval(self) -> AdapterOffForward:
        return self

    def modules(self):
        """The target's modules (where the fused LM head is found)."""
        return self.target.module.modules()

    def train(self, mode: bool = True) -> AdapterOffForward:
        return self


class AdapterOffEngine:
    """A frozen Engine over `target` (a trainable engine of a PeftModel): its model with adapters disabled."""

    trainable = False
    skips_nonfinite_grads = False

    def __init__(self, target, target_role: str):
        from llmtrain.models.lora import is_peft

        if not target.trainable or not is_peft(target.model):
            raise ValueError(f"an adapter-switch reference needs a trainable peft model; role {target_role!r} is "
                             f"{'trainable' if target.trainable else 'frozen'} {type(target.model).__name__}")
        self.target, self.target_role = target, target_role
        self.ctx = target.ctx
        self.dp_rank, self.dp_size, self.dp_group = target.dp_rank, target.dp_size, target.dp_group
        self.sp_rank, self.sp_size, self.sp_group = target.sp_rank, target.sp_size, target.sp_group
        self.model = target.model  # the same module object: nothing of its own
        self.module = AdapterOffForward(target)

    def autocast(self):
        return self.target.autocast()

    def no_sync(self, is_last_micro_batch: bool):
        return contextlib.nullcontext()

    def _frozen(self, *_args, **_kwargs):
        raise RuntimeError(f"the adapter-switch view of {self.target_role!r} is frozen: it has no optimizer")

    backward = clip_or_fused_step = step = skip_step = current_lr = _frozen

    def model_state_bytes(self) -> None:
        return None  # it holds nothing: its weights are the target's, counted there

    def save_checkpoint(self, directory: Path) -> None:
        """A pointer, as for every frozen role: this one names the role whose base it is."""
        if self.ctx.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / FROZEN_MARKER).write_text(json.dumps(
                {"frozen": True, "adapter_off_of": self.target_role,
                 "source": f"role {self.target_role} with its adapters disabled"}, indent=1))

    def load_checkpoint(self, directory: Path) -> None:
        pass  # the target's checkpoint restores the adapters; the base is rebuilt from its source

    def export_hf(self, directory: Path) -> None:
        self._frozen()
