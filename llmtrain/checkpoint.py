"""Atomic, resumable checkpoints: `checkpoints/step_<N>/` with a COMPLETE marker and a `latest` file.

Layout of a step folder:
  engines/<role>/   each role's engine in its backend's own format (frozen roles: `frozen.json`, a pointer
                    to their source: their weights never change)
  rng/rank_<R>.pt   every rank's RNG states
  trainer.json      step, global batch, skipped steps, and `parent` (the step folder this run continued from)
  stage.json        the stage's own state
  config.yaml       the resolved config
Save: every rank writes its pieces into `checkpoints/.tmp_step_<N>/`, every file is fsynced, rank 0 adds
the JSON files, then COMPLETE, renames the folder to `step_<N>` (a folder of the same name is moved aside
first and deleted only after the rename), and only then replaces `latest` atomically. A crash at any point
leaves either a hidden temp folder or a complete step folder: never a torn `latest`. Pruning follows this
run's lineage (the chain of `parent`s from the newest save), so resuming from an older step into the same
run dir never keeps the abandoned continuation nor prunes the checkpoint just written. With
trainer.async_save the engines' files are written in the background (checkpoint_async.py) and the same
finalisation runs once every rank's writes ended (`finalize_pending`): until then the save is the hidden temp
folder, so a crash leaves the previous checkpoint `latest`, and pruning (at finalisation only) never removes it.
Checkpoints of the single-engine layout (`engine/`, `trainer_state.json`) still load as the role "policy".
Everything llmtrain itself loads goes through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from llmtrain.checkpoint_async import PendingSave, checkpoint_group, start_writes
from llmtrain.distributed import DistContext, all_reduce_max, barrier
from llmtrain.faults import inject

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    """Python, NumPy, torch (and CUDA) RNG states in a form torch.load(weights_only=True) accepts."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_complete(step_dir: Path) -> bool:
    return (step_dir / COMPLETE).is_file()


def complete_steps(checkpoints_dir: Path) -> list[Path]:
    """Complete step folders, oldest first; torn ones are skipped with a warning."""
    found = []
    for child in sorted(checkpoints_dir.glob("step_*"), key=lambda p: int(STEP_DIR.match(p.name)[1])
                        if STEP_DIR.match(p.name) else -1):
        if not STEP_DIR.match(child.name) or not child.is_dir():
            continue
        if is_complete(child):
            found.append(child)
        else:
            log.warning("ignoring checkpoint %s: it has no %s marker (the save was interrupted)", child, COMPLETE)
    return found


def has_checkpoints(run_dir: Path) -> bool:
    return bool(list((run_dir / "checkpoints").glob("step_*")))


def find_resume_dir(resume: str | None, run_dir: Path) -> Path | None:
    """The step folder to resume from: `auto` -> the run's newest complete one (or None), PATH -> that."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_complete(run_dir / "checkpoints")
    path = Path(resume)
    if (path / COMPLETE).is_file():
        return path
    if (path / "checkpoints").is_dir():
        found = latest_complete(path / "checkpoints")
        if found is not None:
            return found
    raise FileNotFoundError(f"resume={resume}: no complete checkpoint there (expected a run dir with "
                            f"checkpoints/step_<N>/{COMPLETE} or one step folder)")


def latest_complete(checkpoints_dir: Path) -> Path | None:
    latest_file = checkpoints_dir / "latest"
    if latest_file.is_file():
        named = checkpoints_dir / latest_file.read_text().strip()
        if is_complete(named):
            return named
        log.warning("checkpoints/latest names %s, which is not complete; using the newest complete one", named)
    found = complete_steps(checkpoints_dir) if checkpoints_dir.is_dir() else []
    return found[-1] if found else None


LEGACY_ENGINE, LEGACY_STATE = "engine", "trainer_state.json"  # the single-engine layout


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory` (whoever wrote it) and the folders themselves to disk."""
    for path in sorted(directory.rglob("*"), reverse=True) + [directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` is moved aside first and deleted only after the rename."""
    aside = final.with_name(f".old_{final.name}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def read_trainer_state(step_dir: Path) -> dict:
    path = step_dir / "trainer.json"
    return json.loads((path if path.is_file() else step_dir / LEGACY_STATE).read_text())


def _step_number(step_dir: Path) -> int:
    return int(STEP_DIR.match(step_dir.name)[1])


def lineage(newest: Path) -> list[Path]:
    """`newest` and the step folders it continued from (same run dir), newest first."""
    chain, seen = [], set()
    step_dir = newest
    while step_dir is not None and is_complete(step_dir) and step_dir.name not in seen:
        chain.append(step_dir)
        seen.add(step_dir.name)
        state = read_trainer_state(step_dir)
        if "parent" in state:
            step_dir = newest.parent / state["parent"] if state["parent"] else None
        else:  # written before lineage was recorded: the run's previous step folder by number
            older = [p for p in complete_steps(newest.parent) if _step_number(p) < _step_number(step_dir)]
            step_dir = older[-1] if older else None
    return chain


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last_k: int, ctx: DistContext, parent: str | None = None,
                 async_save: bool = False):
        self.dir = run_dir / "checkpoints"
        self.keep_last_k, self.ctx = keep_last_k, ctx
        self.parent = parent  # the step folder name this run continues from (in this run dir), if any
        self.async_save = async_save  # write in the background (checkpoint_async.py); finalize_pending completes it
        self.group = checkpoint_group() if async_save else None  # the background writes' collectives
        self.pending: PendingSave | None = None

    def save(self, step: int, engines: dict, trainer_state: dict, stage_state: dict, config_yaml: str) -> Path:
        """Write `step_<step>`. With async_save the engines' state is copied to host memory and written in the
        background: the folder appears (COMPLETE, `latest`) only at `finalize_pending`, called by the next save."""
        self.finalize_pending()  # one save in flight at most: the previous one completes first
        final, tmp = self.dir / f"step_{step}", self.dir / f".tmp_step_{step}"
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        barrier()
        # as text now: the stage's state may be live objects that the next steps change while a write is in flight
        finalisation = {"trainer_json": json.dumps({**trainer_state, "parent": self.parent}, indent=1),
                        "stage_json": json.dumps(stage_state, indent=1), "config_yaml": config_yaml}
        if self.async_save:
            writes = start_writes(engines, tmp / "engines", self.group)
            torch.save(rng_state(), tmp / "rng" / f"rank_{self.ctx.rank}.pt")  # small: now
            self.pending = PendingSave.start(step, tmp, final, self.ctx.rank, writes, **finalisation)
            return final
        for role, engine in engines.items():
            engine.save_checkpoint(tmp / "engines" / role)
        torch.save(rng_state(), tmp / "rng" / f"rank_{self.ctx.rank}.pt")
        barrier()
        self._finalize(PendingSave(step, tmp, final, done=None, **finalisation))
        return final

    def finalize_pending(self) -> Path | None:
        """Complete the save written in the background, once every rank's writes ended: the step folder it made
        (None when no save was in flight). Collective: every rank calls it at the same point (the next save, the
        end of fit, a stop, before a rollback reloads the last checkpoint). A write that failed on any rank raises
        on every rank; the checkpoint stays an invisible temp folder and `latest` names the previous one."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        error = pending.wait()
        failed = all_reduce_max(torch.tensor([0 if error is None else 1 + self.ctx.rank]))  # a failed rank, 1-based
        if failed.item():
            why = f"here: {error!r}" if error is not None else "its log says why"
            raise RuntimeError(f"checkpoint step_{pending.step}: its background write failed on rank "
                               f"{int(failed.item()) - 1} ({why}); the checkpoint was not made, checkpoints/latest "
                               "still names the previous one")
        self._finalize(pending)
        return pending.final

    def _finalize(self, save: PendingSave) -> None:
        """Every rank's files are in `save.tmp`: rank 0 adds the JSON files, COMPLETE, renames, `latest`, prunes."""
        inject("save", rank=self.ctx.rank, step=save.step)  # tests: a rank killed inside the save
        if self.ctx.is_main:
            tmp, final = save.tmp, save.final
            (tmp / "trainer.json").write_text(save.trainer_json)
            (tmp / "stage.json").write_text(save.stage_json)
            (tmp / "config.yaml").write_text(save.config_yaml)
            fsync_tree(tmp)
            _write_text_atomic(tmp / COMPLETE, f"step {save.step}\n")
            _replace_dir(tmp, final)
            _write_text_atomic(self.dir / "latest", final.name + "\n")
            self._prune(final)
        self.parent = save.final.name
        barrier()

    def _prune(self, newest: Path) -> None:
        """Keep the newest keep_last_k of this run's lineage; every other complete step folder goes (an
        abandoned continuation after a resume from an older step, and older checkpoints)."""
        keep = {p.name for p in lineage(newest)[:self.keep_last_k]}
        for old in complete_steps(self.dir):
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, step_dir: Path, engines: dict) -> tuple[dict, dict]:
        """Restore every role's engine and this rank's RNG; return (trainer state, stage state)."""
        for role, engine in engines.items():
            engine.load_checkpoint(self._engine_dir(step_dir, role))
        rng_file = step_dir / "rng" / f"rank_{self.ctx.rank}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            log.warning("%s has no RNG state for rank %d (saved with fewer ranks): RNG not restored",
                        step_dir, self.ctx.rank)
        stage_file = step_dir / "stage.json"
        stage_state = json.loads(stage_file.read_text()) if stage_file.is_file() else {}
        if step_dir.resolve().parent == self.dir.resolve():
            self.parent = step_dir.name
        return read_trainer_state(step_dir), stage_state

    @staticmethod
    def _engine_dir(step_dir: Path, role: str) -> Path:
        path = step_dir / "engines" / role
        if not path.exists() and role == "policy" and (step_dir / LEGACY_ENGINE).is_dir():
            return step_dir / LEGACY_ENGINE  # written before roles existed
        if not path.exists():
            raise FileNotFoundError(f"resume: {step_dir} holds no engine for the role {role!r} (it has "
                                    f"{sorted(p.name for p in (step_dir / 'engines').glob('*'))}): it was saved "
                                    "by another stage; resume with that stage or start from its hf/ export")
        return path
