"""The training loop: fetch a step's micro-batches, let the stage step its engines, log, evaluate, save.

`fit()` reads top to bottom. The trainer knows no loss and no model: the stage computes each step over
its engines (one per role) with the shared `Updater`, and its own eval; the trainer times the step,
adds the step counters and the per-rank model-state bytes, hands records to the sinks and checkpoints
every role's engine, the stage's state, its own counters and every rank's RNG.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from llmtrain.distributed import DistContext
from llmtrain.faults import StopSignals, agree_to_stop, collective_guard, corrupt_batches, inject
from llmtrain.metrics.live import NoLiveCost
from llmtrain.metrics.memory import gather_per_rank
from llmtrain.metrics.timing import CommTimer, StepClock
from llmtrain.spikes import SpikeMonitor, SpikeRule, roll_back
from llmtrain.stages.base import NonFiniteError, Updater, trainable_roles  # noqa: F401  (NonFiniteError: re-export)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerSettings:
    max_steps: int
    fetches_per_step: int  # batches drawn per step on a rank: trainer.grad_accum_steps (PPO: 1, its prompts)
    global_batch_size: int  # examples (rows, or pairs) per optimizer step, all ranks
    eval_every_n_steps: int
    save_every_n_steps: int
    skip_nonfinite: bool
    collective_timeout_s: int = 600  # named in the error a timed-out collective raises
    spike: SpikeRule = SpikeRule()  # trainer.spike: loss spikes logged, skipped or rolled back (llmtrain/spikes.py)


class Trainer:
    def __init__(self, settings: TrainerSettings, *, ctx: DistContext, stage, engines: dict,
                 train_batches: Callable[[int], Iterator], eval_batches: Callable[[], Iterable] | None,
                 checkpointer, config_yaml: str, sinks: list, prepare_batch: Callable = lambda batch: batch,
                 live=None, straggler=None, window_examples: Callable[[int, int], list] | None = None):
        self.s, self.ctx, self.stage, self.engines = settings, ctx, stage, engines
        self.train_batches, self.eval_batches = train_batches, eval_batches
        self.checkpointer, self.config_yaml, self.sinks = checkpointer, config_yaml, sinks
        self.prepare_batch = prepare_batch  # device move + attention inputs for this model
        self.live = live or NoLiveCost()  # measured cost on the first steps (metrics/live.py)
        self.updater = Updater(ctx.device, settings.skip_nonfinite)
        self.clock = self.updater.clock = StepClock(ctx.device)  # where each step's time goes (metrics/timing.py)
        self.straggler = straggler  # a StragglerWatch (metrics/straggler.py) or None
        self.step = 0
        # spikes: the decision (None: trainer.spike.policy=off); data_offset: data positions skipped by rollbacks
        self.spikes = None if settings.spike.policy == "off" else SpikeMonitor(settings.spike, ctx.device)
        self.updater.spikes, self.data_offset, self.resumed_from = self.spikes, 0, None
        self.window_examples = window_examples  # (start, stop) data positions -> example indices, for the list

    # ---- state -------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        return {"step": self.step, "global_batch_size": self.s.global_batch_size,
                "skipped_steps": self.updater.skipped_steps, "data_offset": self.data_offset,
                **({"spike": self.spikes.state_dict()} if self.spikes is not None else {})}

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
        self.data_offset, self.resumed_from = state.get("data_offset", 0), step_dir
        if self.spikes is not None and "spike" in state:
            self.spikes.load_state_dict(state["spike"])
        log.info("resumed from %s at step %d", step_dir, self.step)

    # ---- loop --------------------------------------------------------------------------------
    def fit(self) -> bool:
        """Train to max_steps (True), or until a stop signal (False): every rank then saves the step they agreed
        on (llmtrain/faults.py) and returns, so the process exits 0 and a restart resumes from that step."""
        self.batches = self.train_batches(self.data_position())  # replaced by a rollback (llmtrain/spikes.py)
        self.stage.fetch_more = self._fetch_more
        try:
            finished = self._fit()
            self._finish_background_save()
            return finished
        except NonFiniteError:  # raised on every rank together: the save in flight is still made, as a synchronous one
            self._finish_background_save()
            raise
        finally:
            # fetch_more ties trainer, stage and the loader's iterator into a cycle: broken here, the iterator goes
            # when fit returns and stops its workers (else they outlive the run until a garbage collection, which
            # then waits 5 s on each: a process that runs again, as a sweep or a notebook does)
            self.stage.fetch_more = self.batches = None

    def _finish_background_save(self) -> None:
        with self._guard("finishing the checkpoint written in the background"):
            self.checkpointer.finalize_pending()  # trainer.async_save: never exit with a write in flight

    def data_position(self) -> int:
        """The data stream's position after self.step steps (past the windows rollbacks skipped)."""
        return self.stage.data_position(self.step) + self.data_offset

    def _fit(self) -> bool:
        if self.step == 0 and self.eval_batches is not None and self.s.eval_every_n_steps > 0:
            with self._guard("evaluating"):
                self._emit(self.evaluate())
        memory_pending = set(trainable_roles(self.stage.roles))  # logged once each optimizer state exists
        counted, seconds = 0, 0.0
        with StopSignals() as stop, CommTimer(self.clock).timing():
            self.clock.start()  # step 1's window: from here to its row; then from each row to the next
            while self.step < self.s.max_steps:
                with self._guard("running the training step", self.step + 1):
                    record = self._train_step(memory_pending)
                self._emit(record)
                if self.spikes is not None and self.spikes.rollback_pending:
                    with self._guard("rolling back to the last checkpoint after a loss spike"):
                        roll_back(self)
                    continue
                counted, seconds = counted + record[self.stage.count_name], seconds + record["step_time_s"]
                inject("step", rank=self.ctx.rank, step=self.step)
                with self._guard("agreeing whether to stop (one all-reduce per step)"):
                    stopping = agree_to_stop(stop, self.ctx.device)
                last = self.step == self.s.max_steps
                if self.eval_batches is not None and (last or _due(self.step, self.s.eval_every_n_steps)):
                    with self._guard("evaluating"), self.clock.phase("eval"):
                        self._emit(self.evaluate())
                if last or stopping or _due(self.step, self.s.save_every_n_steps):
                    with self._guard("saving a checkpoint"), self.clock.phase("ckpt"):
                        self.save()
                if stopping and not last:
                    log.warning("stopped at step %d on a stop signal (%s on this rank): checkpoint saved; resume "
                                "with resume=auto", self.step, stop.requested or "sent to another rank")
                    return False
        unit = self.stage.count_name
        if self.ctx.is_main and seconds > 0:  # total over total: a median of per-step rates favours short steps
            log.info("trained on %d %s in %.1f s of steps: %.1f %s/s", counted, unit, seconds, counted / seconds, unit)
        return True

    def _train_step(self, memory_pending: set[str]) -> dict:
        with self.clock.phase("data"):
            inject("data", rank=self.ctx.rank, step=self.step + 1)  # tests: a slow loader
            micro_batches = [self.prepare_batch(next(self.batches)) for _ in range(self.s.fetches_per_step)]
        micro_batches = corrupt_batches(micro_batches, rank=self.ctx.rank, step=self.step + 1)  # tests only
        self.updater.step = self.step + 1
        if self.spikes is not None:
            self.spikes.begin_step(self.step + 1)
        with self.live.step(self.step + 1), self.clock.phase("compute"):
            record = {"step": self.step + 1, **self.stage.train_step(micro_batches, self.engines, self.updater)}
        self.step += 1
        times = self.clock.lap()  # from the last row to here: step_time_s and its parts time_<phase>_s
        step_time = times["step_time_s"]
        unit = self.stage.count_name
        record.update({f"{unit}_per_s": record[unit] / step_time, **times, "skipped_steps": self.updater.skipped_steps})
        record.update(self.spikes.record() if self.spikes is not None else {})
        record.update(self._memory(memory_pending))
        record.update(self.live.record(self.step, step_time))
        record.update(self.straggler.observe(self.step, times) if self.straggler is not None else {})
        return record

    def _fetch_more(self):
        """A batch drawn inside the step (PPO's dynamic sampling): data time too."""
        with self.clock.phase("data"):
            return self.prepare_batch(next(self.batches))

    def _guard(self, doing: str, step: int | None = None):
        """A failed or timed-out collective in the block becomes an error naming this rank, the step and `doing`."""
        return collective_guard(rank=self.ctx.rank, step=self.step if step is None else step, doing=doing,
                                timeout_s=self.s.collective_timeout_s)

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
