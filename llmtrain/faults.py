"""Faults the trainer meets: a stop request (preemption), a collective that fails or hangs, and test faults.

- `StopSignals`: SIGTERM / SIGUSR1 (what SLURM sends ahead of a time limit or on preemption, and what torchrun
  forwards to its workers) only set a flag; `agree_to_stop` is the one tiny collective per step that tells
  every rank whether any rank was asked to stop, so that all of them save the same step and exit 0. Repeats
  are ignored (SLURM signals every process of a job step, and torchrun forwards the same signal again).
- `collective_guard`: a collective that times out (trainer.collective_timeout_s) or loses its peer raises
  `CollectiveFailure`, naming the rank, the step and what the loop was doing, with torch's message (gloo
  says the operation, e.g. "recv"; NCCL's watchdog names the collective and its sequence number).
- `inject`: the faults the tests need, at a precise step, with real signals, from the environment variable
  LLMTRAIN_TEST_FAULT="rank=1,step=7,signal=KILL[,at=step|save|write][,target=self|launcher]". It fires only in
  the first attempt (TORCHELASTIC_RESTART_COUNT 0), so a torchrun restart runs clean. A fault
  "sleep=SECONDS,at=data|step|save[,rank=R][,step=S][,every=K]" sleeps there instead (a slow loader, a slow rank, a
  slow save: metrics/timing.py's tests); several faults are joined by ';'. "rank=R,step=S,kind=bad_batch" gives
  rank R's batch of step S labels that blow the loss up, once (`corrupt_batches`: loss spikes, llmtrain/spikes.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import torch

from llmtrain.distributed import abandon_process_group, all_reduce_max

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TEST_FAULT_ENV = "LLMTRAIN_TEST_FAULT"


class CollectiveFailure(RuntimeError):
    """A collective did not complete on this rank: a peer stalled, died or took another code path."""


class StopSignals:
    """While active (a context manager around the loop), SIGTERM and SIGUSR1 set `requested` instead of killing.

    Only around the loop: during start-up (rendezvous, loading) a signal keeps its default action, because a
    rank blocked in a store wait would only see the flag after that wait's timeout.
    """

    def __init__(self):
        self.requested: str | None = None  # the signal's name, once one came
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:  # SLURM signals every process of a step and torchrun forwards: often twice
            log.warning("%s received again: already stopping at the end of this step", name)
            return
        self.requested = name
        log.warning("%s received: saving a checkpoint at the end of this step, then exiting (SIGINT or SIGKILL "
                    "stop at once)", name)

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def agree_to_stop(stop: StopSignals, device: torch.device) -> bool:
    """True on every rank when any rank was asked to stop: one all-reduce of one number."""
    flag = torch.tensor([1 if stop.requested else 0], dtype=torch.int32, device=device)
    return bool(all_reduce_max(flag).item())


def _is_collective_error(error: BaseException) -> bool:
    dist_error = getattr(torch.distributed, "DistError", ())
    if dist_error and isinstance(error, dist_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("gloo", "NCCL", "Timed out", "timed out", "Connection closed by peer",
                                      "Connection reset by peer", "ProcessGroup"))


@contextlib.contextmanager
def collective_guard(*, rank: int, step: int, doing: str, timeout_s: int):
    """Re-raise a failed collective inside the block as a `CollectiveFailure` that says where and what to do."""
    try:
        yield
    except Exception as error:
        if isinstance(error, CollectiveFailure) or not _is_collective_error(error):
            raise
        abandon_process_group()
        raise CollectiveFailure(
            f"rank {rank}: step {step}: a collective did not complete while {doing} (torch: {str(error).strip()}). "
            f"Another rank stalled, died or took another code path; its own log says which. A stall longer than "
            f"trainer.collective_timeout_s={timeout_s} s ends the job: raise it if a step legitimately takes longer "
            "(a slow save on a shared filesystem, a first step that compiles); resume with resume=auto") from error


# ---- test faults ------------------------------------------------------------------------------------

def _parse_fault(text: str) -> dict:
    """One fault of LLMTRAIN_TEST_FAULT (see the module docstring): a signal, a sleep or a bad batch."""
    fields = dict(part.split("=", 1) for part in text.split(",") if part)
    if "sleep" in fields:  # sleep=SECONDS,at=data|step|save[,rank=R][,step=S][,every=K]: see _delay
        if set(fields) - {"sleep", "at", "rank", "step", "every"} or fields.get("at") not in ("data", "step", "save"):
            raise ValueError(f"{TEST_FAULT_ENV}={text!r}: expected sleep=SECONDS,at=data|step|save[,rank=R][,step=S]"
                             "[,every=K]")
        return {"kind": "sleep", "seconds": float(fields["sleep"]), "at": fields["at"],
                "rank": int(fields["rank"]) if "rank" in fields else None,
                "step": int(fields["step"]) if "step" in fields else None, "every": int(fields.get("every", 1))}
    if fields.get("kind") == "bad_batch":  # rank=R,step=S,kind=bad_batch: see corrupt_batches
        if set(fields) != {"rank", "step", "kind"}:
            raise ValueError(f"{TEST_FAULT_ENV}={text!r}: expected rank=R,step=S,kind=bad_batch")
        return {"kind": "bad_batch", "rank": int(fields["rank"]), "step": int(fields["step"])}
    unknown = set(fields) - {"rank", "step", "signal", "at", "target"}
    if unknown or not {"rank", "step", "signal"} <= set(fields):
        raise ValueError(f"{TEST_FAULT_ENV}={text!r}: expected rank=R,step=S,signal=NAME[,at=step|save|write]"
                         "[,target=self|launcher] or rank=R,step=S,kind=bad_batch")
    return {"kind": "signal", "rank": int(fields["rank"]), "step": int(fields["step"]), "at": fields.get("at", "step"),
            "signal": getattr(signal, f"SIG{fields['signal'].upper().removeprefix('SIG')}"),
            "target": fields.get("target", "self")}


def inject(at: str, *, rank: int, step: int) -> None:
    """Send the configured signal when this rank reaches `step` at the point `at` ("step": after the step's
    update, before the stop agreement; "save": inside the save, after every rank wrote its files; "write": on the
    thread of a save written in the background (trainer.async_save), after this rank's files, before COMPLETE)."""
    text = os.environ.get(TEST_FAULT_ENV)
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    text = _delay(text, at, rank=rank, step=step)  # sleep=... faults (several joined by ';'); the rest
    for fault in map(_parse_fault, filter(None, text.split(";"))):
        if fault["kind"] != "signal" or (fault["at"], fault["rank"], fault["step"]) != (at, rank, step):
            continue
        pid = os.getppid() if fault["target"] == "launcher" else os.getpid()
        log.warning("test fault: %s to %s at %s %d", fault["signal"].name, fault["target"], at, step)
        os.kill(pid, fault["signal"])


_corrupted: set[int] = set()  # steps whose batch was corrupted: once per process (a rollback replays the step)


def corrupt_batches(micro_batches: list, *, rank: int, step: int) -> list:
    """LLMTRAIN_TEST_FAULT="rank=R,step=S,kind=bad_batch": on rank R, step S's micro-batches get labels that blow
    the loss up (every position a target, all token id 0: '!' in the shipped byte-level tokenizer, which the tiny
    data never holds), once per process, so the step a rollback replays reads clean data."""
    faults = [_parse_fault(part) for part in os.environ.get(TEST_FAULT_ENV, "").split(";") if "bad_batch" in part]
    if (rank, step) not in {(fault["rank"], fault["step"]) for fault in faults} or step in _corrupted:
        return micro_batches
    _corrupted.add(step)
    log.warning("test fault: bad batch at step %d on rank %d", step, rank)
    return [_blown_up(batch) for batch in micro_batches]


def _blown_up(batch):
    import dataclasses

    if not hasattr(batch, "labels"):
        raise ValueError(f"{TEST_FAULT_ENV}: kind=bad_batch needs a batch with labels (an LM batch), not "
                         f"{type(batch).__name__}")
    labels = torch.zeros_like(batch.labels)  # (B, T)
    return dataclasses.replace(batch, labels=labels, num_targets=int(labels[:, 1:].numel()))


def _delay(text: str, at: str, *, rank: int, step: int) -> str:
    """Sleep for each `sleep=SECONDS,at=data|step|save[,rank=R][,step=S][,every=K]` fault in `text` (faults joined
    by ';') that matches this point ("data": in the step's fetch of its batches, a slow loader): every rank and step
    unless narrowed (`every`: steps divisible by K). Returns the other faults."""
    others = []
    for part in filter(None, text.split(";")):
        fault = _parse_fault(part)
        if fault["kind"] != "sleep":
            others.append(part)
            continue
        if (fault["at"] == at and fault["rank"] in (None, rank) and fault["step"] in (None, step)
                and step % fault["every"] == 0):
            time.sleep(fault["seconds"])
    return ";".join(others)
