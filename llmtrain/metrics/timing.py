"""Where a step's time goes: a clock that splits the wall time from one step's row to the next into named phases.

A window starts when a step's row is written (the first at the loop's start) and ends with the next row, so the
evaluation and the checkpoint save that run after a row belong to the next step's window. Inside it the trainer and
the shared `Updater` enter phases, which nest: the innermost open phase is charged; time in none is `other`.

- `data`: blocked on the loader: `next(batches)` and `prepare_batch` (also PPO's `fetch_more`, which draws inside the
  step), the step's injected test delay too.
- `compute`: the stage's `train_step` (forward, backward; in PPO also generation and experience making) less what
  its nested phases take.
- `optim`: clipping and the optimizer step (`Updater.update`), with the one device sync that fetches the step's
  loss and grad norm.
- `comm`: time blocked inside a torch.distributed collective (`CommTimer`), taken from the phase it happened in. On
  a CPU (gloo) a blocking call's whole time; an asynchronous call (`async_op=True`: DDP's bucket hook, FSDP2's
  prefetch) only its launch: its wait is in the phase that waits. Inside `ckpt` and `eval` a collective is part of
  them (a save's barriers are the save's cost). On a GPU the host returns at once from an NCCL call: the clock
  records CUDA events around each call on the current stream, whose gap is the time that stream stalled on the
  collective (exposed; an async collective's stream never waits there), and moves it from its phase to `comm` at
  the lap. The CUDA path is written from the event semantics and not run by the CPU test suite.
- `ckpt`, `eval`: the save and the held-out evaluation.
On a GPU every phase boundary synchronizes the device, so a phase's host time holds the kernels it queued (the
step already syncs once for its loss; the others are a few per step).

`lap()` ends the window: `step_time_s` and `time_<phase>_s` for every phase, whose sum is `step_time_s` (each
interval of the window is charged to exactly one phase).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from llmtrain.metrics.comm import wrapped_collectives

PHASES = ("data", "compute", "optim", "comm", "ckpt", "eval", "other")
ABSORBING = ("ckpt", "eval")  # a collective inside these counts as theirs, not as exposed communication


def phase_key(phase: str) -> str:
    return f"time_{phase}_s"


class StepClock:
    """Host wall time of each window, split over PHASES. Phases entered before `start()` count nothing."""

    def __init__(self, device: torch.device | None = None, now=time.perf_counter):
        self.cuda = device is not None and device.type == "cuda"
        self.now = now  # seconds (the tests' own clock)
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._stack: list[str] = []
        self._window_start: float | None = None
        self._mark = 0.0  # since when the current phase accrues
        self._thread = threading.get_ident()  # collectives of other threads (a background save) are not the step's
        self._events: list[tuple[str, object, object]] = []  # CUDA: (phase, start, end) around each collective
        self._in_comm = False

    @property
    def running(self) -> bool:
        return self._window_start is not None

    def start(self) -> None:
        self._window_start = self._mark = self.now()
        self._totals, self._stack, self._events = dict.fromkeys(PHASES, 0.0), [], []

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _charge(self) -> None:
        now = self.now()
        self._totals[self._stack[-1] if self._stack else "other"] += now - self._mark
        self._mark = now

    def _mine(self) -> bool:
        return self.running and threading.get_ident() == self._thread

    def enter(self, name: str) -> None:
        """Open a phase until `leave()` (or until the phase around it closes: an exception skips the leave)."""
        if self._mine():
            self._sync()
            self._charge()
            self._stack.append(name)

    def leave(self) -> None:
        if self._mine() and self._stack:
            self._sync()
            self._charge()
            self._stack.pop()

    @contextlib.contextmanager
    def phase(self, name: str):
        depth = len(self._stack)
        self.enter(name)
        try:
            yield
        finally:
            if len(self._stack) > depth + 1:  # inner phases an exception left open: theirs until now
                self._sync()
                self._charge()
                del self._stack[depth + 1:]
            if len(self._stack) > depth:
                self.leave()

    @contextlib.contextmanager
    def comm(self):
        """Around one collective call: its blocking time (CPU) or its stream's stall (CUDA events) is `comm`."""
        if (not self._mine() or self._in_comm
                or (self._stack and self._stack[-1] in ABSORBING)):
            yield  # a collective that calls another (all_gather_object -> all_gather) is timed once, outside
            return
        self._in_comm = True
        try:
            yield from self._timed_comm()
        finally:
            self._in_comm = False

    def _timed_comm(self):
        if not self.cuda:
            self._charge()
            self._stack.append("comm")
            try:
                yield
            finally:
                self._charge()
                self._stack.pop()
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events.append((self._stack[-1] if self._stack else "other", start, end))

    def _settle_events(self) -> None:
        """CUDA: each collective's stall moved from the phase it ran in to comm (never more than that phase had)."""
        if not self._events:
            return
        torch.cuda.synchronize()
        for phase, start, end in self._events:
            seconds = min(start.elapsed_time(end) / 1e3, self._totals[phase])
            self._totals[phase] -= seconds
            self._totals["comm"] += seconds
        self._events = []

    def lap(self) -> dict[str, float]:
        """End the window (outside every phase): {"step_time_s", "time_<phase>_s" ...}; the next window starts now."""
        if self._stack:
            raise RuntimeError(f"StepClock.lap inside the phases {self._stack}")
        self._charge()
        self._settle_events()
        step = self._mark - self._window_start
        out = {"step_time_s": step, **{phase_key(p): v for p, v in self._totals.items()}}
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._window_start = self._mark
        return out


class NoClock:
    """The Updater's default: times nothing."""

    def enter(self, name: str) -> None:
        pass

    def leave(self) -> None:
        pass


# torch.distributed's blocking collectives, wrapped in both namespaces as metrics/comm.py's CommCounter does
TIMED = ("all_reduce", "all_gather_single", "reduce_scatter_single", "reduce", "broadcast", "all_gather",
         "reduce_scatter", "all_to_all_single", "all_to_all", "all_gather_into_tensor", "reduce_scatter_tensor",
         "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter")


class CommTimer:
    """While `timing()` is open, every call of a TIMED function runs inside `clock.comm()`. CommCounter, opened
    inside it on the first steps, wraps these wrappers and restores them after: both see every call."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def _wrap(self, name: str, original):
        clock = self.clock

        def timed(*args, **kwargs):
            with clock.comm():
                return original(*args, **kwargs)

        timed.__wrapped__ = original
        return timed

    @contextlib.contextmanager
    def timing(self):
        with wrapped_collectives(TIMED, self._wrap):
            yield self


def busy(times: dict[str, float]) -> float:
    """A rank's step time less its exposed communication: what it spent working (or sleeping), not waiting on the
    others. In a synchronous step every rank's step time is the same; the slow rank is the one that waits least."""
    return times["step_time_s"] - times[phase_key("comm")]
