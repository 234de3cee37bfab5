"""Checkpoint pruning follows the run's lineage, and a step folder is replaced without a window of loss."""

import json
from pathlib import Path

import torch

from llmtrain.checkpoint import COMPLETE, Checkpointer, _replace_dir, lineage
from llmtrain.distributed import DistContext


def step(checkpoints: Path, n: int, parent: str | None, legacy: bool = False) -> Path:
    folder = checkpoints / f"step_{n}"
    folder.mkdir(parents=True)
    state = {"step": n, "global_batch_size": 8, "skipped_steps": 0}
    if legacy:
        (folder / "trainer_state.json").write_text(json.dumps(state))
    else:
        (folder / "trainer.json").write_text(json.dumps({**state, "parent": parent}))
    (folder / COMPLETE).write_text(f"step {n}\n")
    return folder


def test_lineage_skips_an_abandoned_continuation(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n, parent in ((2, None), (4, "step_2"), (6, "step_4")):
        step(checkpoints, n, parent)
    newest = step(checkpoints, 5, "step_2")  # resumed from step_2, saved at 5: steps 4 and 6 are abandoned
    assert [p.name for p in lineage(newest)] == ["step_5", "step_2"]
    Checkpointer(tmp_path, keep_last_k=3, ctx=DistContext(0, 0, 1, torch.device("cpu")))._prune(newest)
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2", "step_5"]


def test_legacy_checkpoints_continue_the_lineage_by_number(tmp_path):
    step(tmp_path, 2, None, legacy=True)
    step(tmp_path, 4, None, legacy=True)
    newest = step(tmp_path, 6, "step_4")
    assert [p.name for p in lineage(newest)] == ["step_6", "step_4", "step_2"]


def test_a_step_folder_is_replaced_only_once_its_successor_is_complete(tmp_path):
    final, tmp = tmp_path / "step_4", tmp_path / ".tmp_step_4"
    final.mkdir()
    (final / "old").write_text("old")
    tmp.mkdir()
    (tmp / "new").write_text("new")
    _replace_dir(tmp, final)
    assert [p.name for p in final.iterdir()] == ["new"] and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]  # the old copy is gone after the rename


def test_resume_auto_skips_every_kind_of_torn_save(tmp_path, caplog):
    """Where a kill inside a save can leave things: the hidden temp folder (before the rename), a step folder
    without COMPLETE (a copy made by hand, or another tool), and a complete folder that `latest` does not name yet
    (killed between the rename and `latest`): resume=auto takes the step `latest` names, and without a usable
    `latest` the newest complete folder, never a torn one."""
    from llmtrain.checkpoint import find_resume_dir

    checkpoints = tmp_path / "checkpoints"
    step(checkpoints, 5, None)
    (checkpoints / "latest").write_text("step_5\n")
    (checkpoints / ".tmp_step_10" / "rng").mkdir(parents=True)
    torn = checkpoints / "step_15"
    (torn / "engines").mkdir(parents=True)
    assert find_resume_dir("auto", tmp_path) == checkpoints / "step_5"
    step(checkpoints, 10, "step_5")  # renamed, `latest` not replaced yet
    assert find_resume_dir("auto", tmp_path) == checkpoints / "step_5"
    (checkpoints / "latest").write_text("step_15\n")  # names a folder that is not complete
    assert find_resume_dir("auto", tmp_path) == checkpoints / "step_10"
    assert "ignoring checkpoint" in caplog.text and "not complete" in caplog.text
