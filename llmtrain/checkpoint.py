"""Atomic, resumable checkpoints: `checkpoints/step_<N>/` with a COMPLETE marker and a `latest` file.

Save: every rank writes its pieces into `checkpoints/.tmp_step_<N>/` (the engine's own format,
its RNG states), rank 0 adds trainer state + config, then COMPLETE, renames the folder to
`step_<N>`, and only then replaces `latest` atomically. A crash at any point leaves either a
hidden temp folder or a complete step folder: never a torn `latest`. Everything llmtrain itself
loads goes through `torch.load(weights_only=True)`.
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

from llmtrain.parallel import DistContext, barrier

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


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last_k: int, ctx: DistContext):
        self.dir = run_dir / "checkpoints"
        self.keep_last_k, self.ctx = keep_last_k, ctx

    def save(self, step: int, engine, trainer_state: dict, config_yaml: str) -> Path:
        final, tmp = self.dir / f"step_{step}", self.dir / f".tmp_step_{step}"
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        barrier()
        engine.save_checkpoint(tmp / "engine")
        torch.save(rng_state(), tmp / "rng" / f"rank_{self.ctx.rank}.pt")
        barrier()
        if self.ctx.is_main:
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
            (tmp / "config.yaml").write_text(config_yaml)
            _write_text_atomic(tmp / COMPLETE, f"step {step}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_text_atomic(self.dir / "latest", final.name + "\n")
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        for old in complete_steps(self.dir)[:-self.keep_last_k]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, step_dir: Path, engine) -> dict:
        """Restore the engine and this rank's RNG; return the trainer state saved with them."""
        engine.load_checkpoint(step_dir / "engine")
        rng_file = step_dir / "rng" / f"rank_{self.ctx.rank}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            log.warning("%s has no RNG state for rank %d (saved with fewer ranks): RNG not restored",
                        step_dir, self.ctx.rank)
        return json.loads((step_dir / "trainer_state.json").read_text())
