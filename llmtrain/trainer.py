"""The training loop: accumulation, global-batch token normalisation, clipping, eval, checkpoints.

`fit()` reads top to bottom: resume, then per step fetch the micro-batches, forward/backward each,
clip, step, log, maybe evaluate, maybe save. The loss of a step is the token-weighted mean over the
whole global batch (all micro-batches, all ranks): each micro-batch's summed loss is divided by the
global target-token count, counted once per step before the first forward.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from llmtrain.metrics.memory import gather_per_rank
from llmtrain.parallel import DistContext, all_reduce_sum

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    pass


@dataclass(frozen=True)
class TrainerSettings:
    max_steps: int
    grad_accum_steps: int
    global_batch_size: int  # examples (rows) per optimizer step, all ranks
    eval_every_n_steps: int
    save_every_n_steps: int
    skip_nonfinite: bool


class Trainer:
    def __init__(self, settings: TrainerSettings, *, ctx: DistContext, stage, engine,
                 train_batches: Callable[[int], Iterator], eval_batches: Callable[[], Iterable] | None,
                 checkpointer, config_yaml: str, sinks: list, prepare_batch: Callable = lambda batch: batch):
        self.s, self.ctx, self.stage, self.engine = settings, ctx, stage, engine
        self.train_batches, self.eval_batches = train_batches, eval_batches
        self.checkpointer, self.config_yaml, self.sinks = checkpointer, config_yaml, sinks
        self.prepare_batch = prepare_batch  # device move + attention-mask form for this model
        self.step = 0
        self.skipped_steps = 0

    # ---- state -------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        return {"step": self.step, "global_batch_size": self.s.global_batch_size,
                "skipped_steps": self.skipped_steps}

    def resume_from(self, step_dir) -> None:
        state = self.checkpointer.load(step_dir, self.engine)
        if state["global_batch_size"] != self.s.global_batch_size:
            raise ValueError(
                f"resume: the checkpoint was trained with {state['global_batch_size']} examples per step, this run "
                f"has {self.s.global_batch_size} (trainer.micro_batch_size × grad_accum_steps × dp): the data "
                "position would not match; keep the same global batch")
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]
        log.info("resumed from %s at step %d", step_dir, self.step)

    # ---- loop --------------------------------------------------------------------------------
    def fit(self) -> None:
        batches = self.train_batches(self.step)
        if self.step == 0 and self.eval_batches is not None and self.s.eval_every_n_steps > 0:
            self._emit(self.evaluate())
        memory_pending = hasattr(self.engine, "model_state_bytes")  # logged once the optimizer state exists
        tokens, seconds = 0, 0.0
        while self.step < self.s.max_steps:
            start = time.perf_counter()  # the step's clock includes fetching and collating its batches
            micro_batches = [self.prepare_batch(next(batches)) for _ in range(self.s.grad_accum_steps)]
            record = self.train_step(micro_batches, start)
            state_bytes = self.engine.model_state_bytes() if memory_pending else None
            if state_bytes is not None:  # None until measured; the same on every rank
                record.update(gather_per_rank(state_bytes, self.ctx.world_size, self.ctx.rank, self.ctx.device))
                memory_pending = False
            self._emit(record)
            tokens, seconds = tokens + record["tokens"], seconds + record["step_time_s"]
            last = self.step == self.s.max_steps
            if self.eval_batches is not None and (last or _due(self.step, self.s.eval_every_n_steps)):
                self._emit(self.evaluate())
            if last or _due(self.step, self.s.save_every_n_steps):
                self.checkpointer.save(self.step, self.engine, self.trainer_state(), self.config_yaml)
        if self.ctx.is_main and seconds > 0:  # total over total: a median of per-step rates favours short steps
            log.info("trained on %d target tokens in %.1f s of steps: %.0f target tokens/s", tokens, seconds,
                     tokens / seconds)

    def train_step(self, micro_batches: list, start: float) -> dict:
        self.engine.module.train()
        local_targets = sum(b.num_targets for b in micro_batches)  # counted on the host: no device sync
        global_targets = int(all_reduce_sum(torch.tensor([local_targets], dtype=torch.float64,
                                                         device=self.ctx.device), self.engine.dp_group).item())
        inv_targets = 1.0 / max(global_targets, 1)  # zero targets: loss 0, gradient 0, never NaN
        loss_sum = torch.zeros((), device=self.ctx.device)
        for i, batch in enumerate(micro_batches):
            with self.engine.no_sync(is_last_micro_batch=i == len(micro_batches) - 1):
                with self.engine.autocast():
                    micro_loss_sum = self.stage.micro_batch_loss(self.engine.module, batch)
                self.engine.backward(micro_loss_sum * inv_targets)
            loss_sum += micro_loss_sum.detach().float()
        loss_sum = all_reduce_sum(loss_sum, self.engine.dp_group)
        lr = self.engine.current_lr()  # this step's lr: read before clip_grad_norm (DeepSpeed updates there)
        loss_sum, grad_norm = _to_host(loss_sum, self.engine.clip_grad_norm())  # one device sync for both
        loss = loss_sum * inv_targets
        self.step += 1
        if math.isfinite(loss) and (math.isfinite(grad_norm) or self.engine.skips_nonfinite_grads):
            self.engine.step()
        else:
            self._handle_nonfinite(loss, grad_norm)
        step_time = time.perf_counter() - start
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": global_targets,
                "tokens_per_s": global_targets / step_time, "step_time_s": step_time,
                "skipped_steps": self.skipped_steps}

    def _handle_nonfinite(self, loss: float, grad_norm: float) -> None:
        # Loss and grad norm are reduced over all ranks, so every rank takes the same branch here.
        if not self.s.skip_nonfinite:
            raise NonFiniteError(
                f"step {self.step}: loss={loss} grad_norm={grad_norm} is not finite; all ranks stop here. "
                "Lower optim.lr, check the data, or set trainer.skip_nonfinite=true to skip such steps")
        self.skipped_steps += 1
        log.warning("step %d: loss=%s grad_norm=%s not finite, step skipped (%d so far)",
                    self.step, loss, grad_norm, self.skipped_steps)
        self.engine.skip_step()

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.engine.module.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # loss sum, targets, correct
        for batch in self.eval_batches():
            with self.engine.autocast():
                sums += self.stage.eval_sums(self.engine.module, self.prepare_batch(batch)).double()
        loss_sum, targets, correct = all_reduce_sum(sums, self.engine.dp_group).tolist()
        eval_loss = loss_sum / max(targets, 1)
        return {"step": self.step, "eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0)),
                "eval_accuracy": correct / max(targets, 1), "eval_tokens": int(targets)}

    def _emit(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record)


def _to_host(*scalars: torch.Tensor) -> list[float]:
    """0-d tensors as floats, with one device sync for all of them (fp32 -> fp64 is exact)."""
    device = scalars[0].device
    return torch.stack([scalar.detach().to(device, torch.float64) for scalar in scalars]).tolist()


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0
