"""The slow rank, named: every `trainer.log_every_n_steps` steps each rank's mean times over the window are gathered.

In a synchronous step every rank's step time is the same (the fast ones wait for the slow one in a collective), so
ranks are compared by their busy time: step time less exposed communication (metrics/timing.py `busy`). A rank whose
busy time exceeds the median of all ranks' (the lower middle one of an even count: of 2 ranks, the faster) by more
than `trainer.straggler_threshold` (a fraction of the median) in `trainer.straggler_windows` windows in a row is
named: a warning on rank 0 and `straggler_rank` in the row.

Keys in the window's row (metrics.jsonl; W&B group time/): `time_r<rank>_step_s`, `time_r<rank>_busy_s` and
`time_r<rank>_<phase>_s` (window means), `straggler_rank` (-1: none) and `straggler_busy_ratio` (the slowest rank's
busy time over the median).
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from llmtrain.metrics.memory import gather_per_rank
from llmtrain.metrics.timing import PHASES, busy, phase_key

log = logging.getLogger(__name__)

MIN_EXCESS_S = 1e-3  # below a millisecond a step's busy time is scheduler noise, whatever the ratio


def slow_rank(busy_times: list[float], threshold: float) -> int | None:
    """The rank whose busy time exceeds the median's (1 + threshold) times, the slowest if several; else None."""
    median = statistics.median_low(busy_times)
    worst = max(range(len(busy_times)), key=busy_times.__getitem__)
    excess = busy_times[worst] - median
    return worst if excess > threshold * median and excess > MIN_EXCESS_S else None


def straggler_problems(t: Any) -> list[str]:
    problems = []
    if not t.straggler_threshold > 0:
        problems.append(f"trainer.straggler_threshold={t.straggler_threshold} must be > 0 (a fraction of the "
                        "median rank's busy time, e.g. 0.2)")
    if t.straggler_windows < 1:
        problems.append(f"trainer.straggler_windows={t.straggler_windows} must be >= 1 (windows of "
                        "trainer.log_every_n_steps steps in a row)")
    return problems


class StragglerWatch:
    """`observe(step, times)` after every step's lap: {} except at the end of a window, where it gathers (a
    collective on every rank: windows end at the same steps everywhere) and returns the window's keys."""

    def __init__(self, *, every: int, threshold: float, windows: int, ctx):
        self.every, self.threshold, self.windows, self.ctx = every, threshold, windows, ctx
        self.candidate, self.streak, self.named = None, 0, None
        self._reset()

    def _reset(self) -> None:
        self.count, self.sums = 0, dict.fromkeys(("step_time_s", *map(phase_key, PHASES)), 0.0)

    def observe(self, step: int, times: dict[str, float]) -> dict[str, float]:
        if self.ctx.world_size == 1 or self.every <= 0:
            return {}
        for key in self.sums:
            self.sums[key] += times[key]
        self.count += 1
        if step % self.every:
            return {}
        means = {key: value / self.count for key, value in self.sums.items()}
        local = {"step_s": means["step_time_s"], "busy_s": busy(means),
                 **{phase_key(p).removeprefix("time_"): means[phase_key(p)] for p in PHASES}}
        self._reset()
        out = gather_per_rank(local, self.ctx.world_size, self.ctx.rank, self.ctx.device, prefix="time")
        busy_times = [out[f"time_r{r}_busy_s"] for r in range(self.ctx.world_size)]
        named = self.decide(busy_times)
        if named != self.named and self.ctx.is_main:
            self._report(step, named, busy_times, out)
        self.named = named
        median = statistics.median_low(busy_times)
        out.update(straggler_rank=-1 if named is None else named,
                   straggler_busy_ratio=max(busy_times) / median if median > 0 else 1.0)
        return out

    def decide(self, busy_times: list[float]) -> int | None:
        """One window's verdict: the rank slow in the last `windows` windows in a row, else None."""
        slow = slow_rank(busy_times, self.threshold)
        self.streak = self.streak + 1 if slow is not None and slow == self.candidate else int(slow is not None)
        self.candidate = slow
        return slow if self.streak >= self.windows else None

    def _report(self, step: int, named: int | None, busy_times: list[float], out: dict) -> None:
        if named is None:
            log.info("step %d: no straggler any more (rank %s was named)", step, self.named)
            return
        median = statistics.median_low(busy_times)
        typical = busy_times.index(median)
        extra = {p: out[f"time_r{named}_{p}_s"] - out[f"time_r{typical}_{p}_s"] for p in PHASES if p != "comm"}
        part = max(extra, key=extra.get)
        log.warning("step %d: rank %d is a straggler: busy %.3f s a step against the ranks' median %.3f s (+%.0f%%) "
                    "for %d windows of %d steps; its excess is in %s: +%.3f s a step over rank %d's (python -m "
                    "llmtrain.doctor RUN_DIR)", step, named, busy_times[named], median,
                    100 * (busy_times[named] / median - 1) if median else 0, self.streak, self.every, part,
                    extra[part], typical)
