"""Loss spikes (trainer.spike): a step whose loss (or grad norm) exceeds `factor` × a running statistic.

The statistic is the median of the last `window` values of the monitored metric, once `warmup_steps` values were
seen; a median, so that a spike does not lift the bar it is measured against (every finite value enters the window,
so a lasting rise becomes the new level after window/2 steps instead of being flagged forever). The values are the
globally reduced loss and grad norm the shared `Updater` computes, and the flag itself is max-reduced over every
rank, so all ranks decide together. Each `Updater.update` call of a trainer step keeps its own window (the k-th call
of a step: SFT's one update; PPO's actor and critic mini-batches), so like is compared with like.

Policies: `log` (metrics only), `skip` (no optimizer step, as `trainer.skip_nonfinite` does: the schedule still
advances), `rollback` (the step is discarded; the trainer reloads the last complete checkpoint and moves the data
position past every window read since it, listing those examples in `skipped_data.jsonl`). The monitor's state
(windows, counts) is saved in `trainer.json`, so a resume decides exactly as the straight run would.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain.checkpoint import latest_complete
from llmtrain.distributed import all_reduce_max
from llmtrain.stages.base import NonFiniteError

log = logging.getLogger(__name__)

SKIPPED_DATA = "skipped_data.jsonl"  # in the run dir: one line per rollback


class SpikeError(NonFiniteError):
    """Too many rollbacks: the run stops (exit code 3, as a non-finite step does)."""


@dataclass(frozen=True)
class SpikeRule:
    """trainer.spike as plain values (the config stops at builders)."""
    policy: str = "off"
    metric: str = "loss"
    factor: float = 3.0
    window: int = 50
    warmup_steps: int = 20
    max_rollbacks: int = 3

    @classmethod
    def from_config(cls, spike_cfg) -> SpikeRule:
        return cls(policy=spike_cfg.policy, metric=spike_cfg.metric, factor=float(spike_cfg.factor),
                   window=int(spike_cfg.window), warmup_steps=int(spike_cfg.warmup_steps),
                   max_rollbacks=int(spike_cfg.max_rollbacks))


def spike_problems(cfg: Any, updates_in_clip: tuple[str, ...] = ()) -> list[str]:
    """trainer.spike's fields (the policy and metric names are checked with the schema's CHOICES);
    `updates_in_clip`: the backends that apply the update before the loss is known (DeepSpeed)."""
    s, t = cfg.trainer.spike, cfg.trainer
    if s.policy == "off":
        return []
    problems = []
    if s.policy == "skip" and cfg.backend.name in updates_in_clip:
        problems.append(f"trainer.spike.policy=skip cannot skip under backend.name={cfg.backend.name}: it applies "
                        "the update in the same call that computes the grad norm; use policy=rollback or log")
    if not s.factor > 1:
        problems.append(f"trainer.spike.factor={s.factor} must be > 1 (a spike is a value above factor × the "
                        "running median): use e.g. 3.0")
    if s.window < 1:
        problems.append(f"trainer.spike.window={s.window} must be >= 1 (values the running median is taken over)")
    if s.warmup_steps < 1:
        problems.append(f"trainer.spike.warmup_steps={s.warmup_steps} must be >= 1 (values seen before a spike "
                        "can be called)")
    if s.policy == "rollback" and t.save_every_n_steps < 1:
        problems.append(f"trainer.spike.policy=rollback needs checkpoints to roll back to, but "
                        f"trainer.save_every_n_steps={t.save_every_n_steps}: set it >= 1, or use policy=skip")
    if s.policy == "rollback" and s.max_rollbacks < 1:
        problems.append(f"trainer.spike.max_rollbacks={s.max_rollbacks} must be >= 1 under policy=rollback "
                        "(or use policy=skip)")
    return problems


def spike_ratio(value: float, history: list[float], warmup_steps: int, seen: int) -> float | None:
    """value / the median of `history`; None during the warm-up or when the median is not positive (a loss that
    can be negative, as PPO's, has no ratio to speak of)."""
    if seen < warmup_steps or not history:
        return None
    median = statistics.median(history)
    return value / median if median > 0 else None


def is_spike(ratio: float | None, factor: float) -> bool:
    return ratio is not None and ratio > factor


class SpikeMonitor:
    """The running statistic and the decision, called by `Updater.update` once per update (see the module doc)."""

    def __init__(self, rule: SpikeRule, device: torch.device):
        self.rule, self.device = rule, device
        self.windows: list[list[float]] = []  # per update of a step: its last `window` values, oldest first
        self.seen: list[int] = []  # per update of a step: values observed so far
        self.spikes = self.spike_skipped_steps = self.rollbacks = 0
        self.step, self._call = 0, 0
        self.step_spike, self.step_ratio = False, None  # this step's decision and largest ratio

    def begin_step(self, step: int) -> None:
        self.step, self._call, self.step_spike, self.step_ratio = step, 0, False, None

    def accept(self, loss: float, grad_norm: float) -> bool:
        """Whether the update goes ahead: False on a spike under policy skip or rollback (every rank together)."""
        value = loss if self.rule.metric == "loss" else grad_norm
        call, self._call = self._call, self._call + 1
        while len(self.windows) <= call:
            self.windows.append([])
            self.seen.append(0)
        ratio = spike_ratio(value, self.windows[call], self.rule.warmup_steps, self.seen[call])
        flag = torch.tensor([int(is_spike(ratio, self.rule.factor))], dtype=torch.int32, device=self.device)
        spike = bool(all_reduce_max(flag).item())  # the values are reduced already; the flag makes sure
        self.windows[call] = (self.windows[call] + [value])[-self.rule.window:]
        self.seen[call] += 1
        if ratio is not None:
            self.step_ratio = ratio if self.step_ratio is None else max(self.step_ratio, ratio)
        if not spike:
            return True
        self.spikes += 1
        self.step_spike = True
        log.warning("step %d: spike: %s=%s is %s × the running median (trainer.spike.factor=%s): policy %s",
                    self.step, self.rule.metric, value, "?" if ratio is None else f"{ratio:.3f}", self.rule.factor,
                    self.rule.policy)
        if self.rule.policy == "skip":
            self.spike_skipped_steps += 1
        return self.rule.policy == "log"

    @property
    def rollback_pending(self) -> bool:
        return self.step_spike and self.rule.policy == "rollback"

    def record(self) -> dict:
        """This step's metrics: spike (0/1), spike_ratio (once past the warm-up) and the counts."""
        record = {"spike": int(self.step_spike), "spikes": self.spikes, "spike_skipped_steps": self.spike_skipped_steps,
                  "spike_rollbacks": self.rollbacks}
        if self.step_ratio is not None:
            record["spike_ratio"] = self.step_ratio
        return record

    def state_dict(self) -> dict:
        return {"windows": self.windows, "seen": self.seen, "spikes": self.spikes,
                "spike_skipped_steps": self.spike_skipped_steps, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.windows, self.seen = [list(w) for w in state["windows"]], list(state["seen"])
        self.spikes, self.spike_skipped_steps = state["spikes"], state["spike_skipped_steps"]
        self.rollbacks = state["rollbacks"]


def roll_back(trainer) -> None:
    """After a spike under policy=rollback (the step's update was discarded), on every rank: reload the last complete
    checkpoint (a background save in flight completes first), keep the spike counts, and move the data position past
    every window read since the checkpoint, listed in skipped_data.jsonl. With no checkpoint yet the step stays
    skipped (counted in spike_skipped_steps)."""
    monitor, rule, spike_step = trainer.spikes, trainer.s.spike, trainer.step
    run_dir = trainer.checkpointer.dir.parent
    trainer.checkpointer.finalize_pending()  # a save in flight is the checkpoint to roll back to
    target = latest_complete(trainer.checkpointer.dir) or trainer.resumed_from
    if target is None:
        monitor.spike_skipped_steps += 1
        log.warning("step %d: no complete checkpoint to roll back to yet: the step stays skipped", spike_step)
        return
    if monitor.rollbacks >= rule.max_rollbacks:
        raise too_many_rollbacks(spike_step, rule, run_dir)
    end, counts = trainer.data_position(), (monitor.spikes, monitor.spike_skipped_steps, monitor.rollbacks + 1)
    trainer.resume_from(target)  # the windows of the statistic come back with it: a resume decides the same
    start = trainer.data_position()
    trainer.data_offset += end - start
    monitor.spikes, monitor.spike_skipped_steps, monitor.rollbacks = counts
    log.warning("step %d: loss spike: rolled back to %s (rollback %d of at most %d); data positions %d..%d skipped",
                spike_step, target.name, monitor.rollbacks, rule.max_rollbacks, start, end - 1)
    if trainer.ctx.is_main:
        examples = None if trainer.window_examples is None else trainer.window_examples(start, end)
        list_skipped(run_dir, spike_step=spike_step, resumed_from=target.name, positions=(start, end),
                     examples=examples)
    trainer.batches = trainer.train_batches(trainer.data_position())


def too_many_rollbacks(step: int, rule: SpikeRule, run_dir: Path) -> SpikeError:
    return SpikeError(
        f"step {step}: a loss spike after trainer.spike.max_rollbacks={rule.max_rollbacks} rollbacks; every rank "
        f"stops here. The data skipped so far is listed in {run_dir / SKIPPED_DATA}: check it, lower optim.lr, raise "
        "trainer.spike.factor or trainer.spike.max_rollbacks, or use trainer.spike.policy=skip")


def window_examples(examples, global_batch: int, seed: int,
                    group_by_length: bool) -> Callable[[int, int], list[list[int]]]:
    """(start, stop) data positions -> the example indices of each position's global window, as every rank's
    sampler draws them together (data/sampler.py: a pure function of the position). Built at the first rollback."""
    def windows(start: int, stop: int) -> list[list[int]]:
        from llmtrain.data.sampler import StepBatchSampler

        sampler = StepBatchSampler(len(examples), micro_batch_size=global_batch, grad_accum_steps=1, dp_rank=0,
                                   dp_size=1, seed=seed, lengths=examples.row_lengths() if group_by_length else None)
        return [sampler.micro_batches(position)[0] for position in range(start, stop)]

    return windows


def list_skipped(run_dir: Path, *, spike_step: int, resumed_from: str, positions: tuple[int, int],
                 examples: list[list[int]] | None) -> None:
    """Append one rollback's skipped data window to skipped_data.jsonl (rank 0)."""
    line = {"spike_step": spike_step, "rolled_back_to": resumed_from, "data_positions": list(positions)}
    if examples is not None:
        line["examples"] = examples  # per position, the global window's example indices
    with open(run_dir / SKIPPED_DATA, "a") as f:
        f.write(json.dumps(line) + "\n")
