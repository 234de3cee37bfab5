"""The training loop: fetch a step's micro-batches, let the stage step its engines, log, evaluate, save.

`fit()` reads top to bottom. The trainer knows no loss and no model: the stage computes each step over
its engines (one per role) with the shared `Updater`, and its own eval; the trainer times the step,
adds the step counters and the per-rank model-state bytes, hands records to the sinks and checkpoints
every role's engine, the stage's state, its own counters and every rank's RNG.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from llmtrain.metrics.live import NoLiveCost
from llmtrain.metrics.memory import gather_per_rank
from llmtrain.parallel import DistContext
from llmtrain.stages.base import NonFiniteError, Updater, trainable_roles  # noqa: F401  (NonFiniteError: re-export)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerSettings:
    max_steps: int
    grad_accum_steps: int
    global_batch_size: int  # examples (rows, or pairs) per optimizer step, all ranks
    eval_every_n_steps: int
    save_every_n_steps: int
    skip_nonfinite: bool


class Trainer:
    def __init__(self, settings: TrainerSettings, *, ctx: DistContext, stage, engines: dict,
                 train_batches: Callable[[int], Iterator], eval_batches: Callable[[], Iterable] | None,
                 checkpointer, config_yaml: str, sinks: list, prepare_batch: Callable = lambda batch: batch,
                 live=None):
        self.s, self.ctx, self.stage, self.engines = settings, ctx, stage, engines
        self.train_batches, self.eval_batches = train_batches, eval_batches
        self.checkpointer, self.config_yaml, self.sinks = checkpointer, config_yaml, sinks
        self.prepare_batch = prepare_batch  # device move + attention inputs for this model
        self.live = live or NoLiveCost()  # measured cost on the first steps (metrics/live.py)
        self.updater = Updater(ctx.device, settings.skip_nonfinite)
        self.step = 0

    # ---- state -------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        return {"step": self.step, "global_batch_size": self.s.global_batch_size,
                "skipped_steps": self.updater.skipped_steps}

    def save(self) -> None:
        self.checkpointer.save(self.step, self.engines, self.trainer_state(), self.stage.state_dict(),
                               self.config_yaml)

    def resume_from(self, step_dir) -> None:
        state, stage_state = self.checkpointer.load(step_dir, self.engines)
        if state["global_batch_size"] != self.s.global_batch_size:
            raise ValueError(
                f"resume: the checkpoint was trained with {state['global_batch_size']} examples per step, this run "
                f"has {self.s.global_batch_size} (trainer.micro_batch_size × grad_accum_steps × dp): the data "
                "position would not match; keep the same global batch")
        self.step, self.updater.skipped_steps = state["step"], state["skipped_steps"]
        self.stage.load_state_dict(stage_state)
        log.info("resumed from %s at step %d", step_dir, self.step)

    # ---- loop --------------------------------------------------------------------------------
    def fit(self) -> None:
        batches = self.train_batches(self.step)
        if self.step == 0 and self.eval_batches is not None and self.s.eval_every_n_steps > 0:
            self._emit(self.evaluate())
        memory_pending = set(trainable_roles(self.stage.roles))  # logged once each optimizer state exists
        counted, seconds = 0, 0.0
        while self.step < self.s.max_steps:
            start = time.perf_counter()  # the step's clock includes fetching and collating its batches
            micro_batches = [self.prepare_batch(next(batches)) for _ in range(self.s.grad_accum_steps)]
            self.updater.step = self.step + 1
            with self.live.step(self.step + 1):
                record = {"step": self.step + 1, **self.stage.train_step(micro_batches, self.engines, self.updater)}
            self.step += 1
            step_time = time.perf_counter() - start
            unit = self.stage.count_name
            record.update({f"{unit}_per_s": record[unit] / step_time, "step_time_s": step_time,
                           "skipped_steps": self.updater.skipped_steps})
            record.update(self._memory(memory_pending))
            record.update(self.live.record(self.step, step_time))
            self._emit(record)
            counted, seconds = counted + record[unit], seconds + step_time
            last = self.step == self.s.max_steps
            if self.eval_batches is not None and (last or _due(self.step, self.s.eval_every_n_steps)):
                self._emit(self.evaluate())
            if last or _due(self.step, self.s.save_every_n_steps):
                self.save()
        if self.ctx.is_main and seconds > 0:  # total over total: a median of per-step rates favours short steps
            log.info("trained on %d %s in %.1f s of steps: %.1f %s/s", counted, unit, seconds, counted / seconds, unit)

    def _memory(self, pending: set[str]) -> dict:
        """Each trainable role's per-rank model-state bytes, once measured (`memory_r<rank>_<key>`, other
        roles than the first prefixed with their name). The same on every rank, so the gather is safe."""
        record = {}
        first = trainable_roles(self.stage.roles)[0]
        for role in sorted(pending):
            state_bytes = self.engines[role].model_state_bytes()
            if state_bytes is None:
                continue
            gathered = gather_per_rank(state_bytes, self.ctx.world_size, self.ctx.rank, self.ctx.device)
            record.update({k if role == first else f"{role}_{k}": v for k, v in gathered.items()})
            pending.discard(role)
        return record

    def evaluate(self) -> dict:
        batches = (self.prepare_batch(batch) for batch in self.eval_batches())
        return {"step": self.step, **self.stage.evaluate(batches, self.engines)}

    def _emit(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record)


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0
