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
run dir never keeps the abandoned continuation nor prunes the checkpoint just written. Checkpoints of the
single-engine layout (`engine/`, `trainer_state.json`) still load as the role "policy". Everything llmtrain
itself loads goes through `torch.load(weights_only=True)`.
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

from llmtrain.distributed import DistContext, barrier
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
    def __init__(self, run_dir: Path, keep_last_k: int, ctx: DistContext, parent: str | None = None):
        self.dir = run_dir / "checkpoints"
        self.keep_last_k, self.ctx = keep_last_k, ctx
        self.parent = parent  # the step folder name this run continues from (in this run dir), if any

    def save(self, step: int, engines: dict, trainer_state: dict, stage_state: dict, config_yaml: str) -> Path:
        final, tmp = self.dir / f"step_{step}", self.dir / f".tmp_step_{step}"
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        barrier()
        for role, engine in engines.items():
            engine.save_checkpoint(tmp / "engines" / role)
        torch.save(rng_state(), tmp / "rng" / f"rank_{self.ctx.rank}.pt")
        barrier()
        inject("save", rank=self.ctx.rank, step=step)  # tests: a rank killed inside the save
        if self.ctx.is_main:
            (tmp / "trainer.json").write_text(json.dumps({**trainer_state, "parent": self.parent}, indent=1))
            (tmp / "stage.json").write_text(json.dumps(stage_state, indent=1))
            (tmp / "config.yaml").write_text(config_yaml)
            fsync_tree(tmp)
            _write_text_atomic(tmp / COMPLETE, f"step {step}\n")
            _replace_dir(tmp, final)
            _write_text_atomic(self.dir / "latest", final.name + "\n")
            self._prune(final)
        self.parent = final.name
        barrier()
        return final

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
