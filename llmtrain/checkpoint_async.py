"""Checkpoints written in the background (`trainer.async_save=true`): the step copies the state to host memory and
returns; threads write it while training goes on; the save is finalised (COMPLETE, rename, `latest`, prune: see
checkpoint.py) only once every rank's writes ended, at a point where every rank agrees on it (the next save, the end
of fit, a stop signal, a rollback: `Checkpointer.finalize_pending`).

The engine seam: `engine.save_checkpoint_async(directory, group) -> [Future]` copies this rank's state to host
memory before it returns (the weights change at the next step) and hands back the futures of its writes. DDP writes
rank 0's copy with `torch.save` on a thread (`in_background`); FSDP2 uses `torch.distributed.checkpoint.async_save`,
whose planning runs collectives from its writer thread: on `group`, a gloo group of its own, because training's
collectives on the default group run at the same time on the main thread (two threads on one group would
interleave their collectives). DeepSpeed has none (validation refuses `trainer.async_save` there: see
backends/deepspeed_spec.py).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from llmtrain.faults import inject

log = logging.getLogger(__name__)


def in_background(write: Callable[[], object]) -> Future:
    """Run `write` on a thread of its own; the future holds its result or its exception. The thread is not a
    daemon: an interpreter that exits normally waits for it (the trainer waits before that: finalize_pending)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmtrain-checkpoint")
    future = executor.submit(write)
    executor.shutdown(wait=False)  # the thread ends after this one write
    return future


def host_copy(state):
    """`state` (nested dicts / lists of tensors and Python values) with every tensor copied to host memory: a copy
    even of a CPU tensor, so that the optimizer step after the save cannot change what is being written."""
    return tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, state)


def write_files(directory: Path, staged: dict[str, object]) -> None:
    """`torch.save` each staged object (file name -> host copy) into `directory`, flushed to disk here, off the
    training thread (the finalisation's fsync of the folder then finds these files clean)."""
    for name, obj in staged.items():
        with open(directory / name, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())


def start_writes(engines: dict, engines_dir: Path, group) -> list[Future]:
    """Every role's engine copied to host memory and its writes started (a frozen role: its pointer, written now)."""
    writes = []
    for role, engine in engines.items():
        if not engine.trainable:
            engine.save_checkpoint(engines_dir / role)
        elif hasattr(engine, "save_checkpoint_async"):
            writes += engine.save_checkpoint_async(engines_dir / role, group)
        else:  # validation refuses trainer.async_save for such a backend: see backends/*_spec.py
            raise NotImplementedError(f"trainer.async_save=true: the {type(engine).__name__} of role {role!r} "
                                      "cannot write in the background; set trainer.async_save=false")
    return writes


def checkpoint_group():
    """A gloo group over every rank for the background writes' collectives (None without a process group).
    Created by every rank at the same point (the Checkpointer's construction), as torch requires of new groups."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(backend="gloo")


@dataclass
class PendingSave:
    """One save whose files are still being written on this rank, and what its finalisation writes."""
    step: int
    tmp: Path
    final: Path
    trainer_json: str  # trainer.json's text (its `parent` included), stage.json's, config.yaml's
    stage_json: str
    config_yaml: str
    done: Future  # this rank's writes, then the test fault point `at=write` (llmtrain/faults.py)

    @classmethod
    def start(cls, step: int, tmp: Path, final: Path, rank: int, writes: list[Future], **finalisation) -> PendingSave:
        def all_written() -> None:
            for write in writes:
                write.result()  # re-raises a failed write
            inject("write", rank=rank, step=step)  # tests: a rank killed in a background write, before COMPLETE

        return cls(step, tmp, final, done=in_background(all_written), **finalisation)

    def wait(self) -> BaseException | None:
        """Block until this rank's writes ended: None when they all succeeded, else the first error."""
        try:
            self.done.result()
            return None
        except Exception as error:  # reported, then agreed on over every rank by the caller
            log.error("checkpoint step_%d: a background write failed on this rank: %r", self.step, error)
            return error
