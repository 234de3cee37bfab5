"""notebooks/ppo_dashboard.ipynb executed with nbclient on a short fresh ppo_tiny run (6 iterations of 8 prompts,
greedy evaluations at steps 0, 3, 6 on 32 held-out prompts): it passes its own checks and summarises the run; on
broken copies of that run's metrics.jsonl it fails with the message naming the break; a ratio deviation on a run
that is not fp32 CPU is flagged, not failed."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from tests.e2e.notebooks import edited_copy, printed
from tests.e2e.notebooks import execute as run_notebook
from tests.helpers import REPO, assert_ok, read_metrics, run_cli

pytestmark = pytest.mark.e2e

NOTEBOOK = REPO / "notebooks" / "ppo_dashboard.ipynb"
EVAL_PROMPTS = REPO / "llmtrain" / "assets" / "data" / "reverse_eval.jsonl"


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ppo_nb")
    eval_file = root / "eval.jsonl"
    eval_file.write_text("".join(EVAL_PROMPTS.read_text().splitlines(keepends=True)[:32]))
    run_dir = root / "run"
    result = run_cli(["recipe=ppo_tiny", "trainer.max_steps=6", "trainer.eval_every_n_steps=3",
                      "ppo.rollout.prompts_per_step=8", "ppo.mini_batch_size=8", "trainer.micro_batch_size=8",
                      "trainer.eval_batch_size=32", f"data.eval_files=[{eval_file}]", f"output_dir={run_dir}"])
    assert_ok(result)
    return run_dir


def execute(run_dir: Path, kernel_name: str, monkeypatch) -> nbformat.NotebookNode:
    return run_notebook(NOTEBOOK, run_dir, kernel_name, monkeypatch)


def test_summarises_a_fresh_ppo_run(ppo_run, kernel_name, monkeypatch):
    train, evals = read_metrics(ppo_run)
    nb = execute(ppo_run, kernel_name, monkeypatch)
    out = printed(nb)
    assert "consistent: steps 1..6, PPO with a critic, first_ratio_dev max 0, 3 evaluations at steps [0, 3, 6]" in out
    summary = " ".join(printed(nb, "summary").split())  # undo the notebook's line wrapping
    assert f"Score {train[0]['score']:.3f} at step 1, {train[-1]['score']:.3f} at step 6" in summary, summary
    assert f"explained variance last {train[-1]['explained_var']:.3f}" in summary, summary
    assert (f"exact match {evals[0]['eval_exact_match']:.3f} at step 0, {evals[-1]['eval_exact_match']:.3f} at step 6"
            in summary), summary
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not images and "tables instead of plots" in out
    else:
        assert len(images) == 1


def _drop_clip_frac_at_4(records):
    for r in records:
        if r["step"] == 4 and "score" in r:
            del r["clip_frac"]
    return records


def _swap_steps_3_and_4(records):
    train = [r for r in records if "score" in r]
    i, j = records.index(train[2]), records.index(train[3])
    records[i], records[j] = records[j], records[i]
    return records


def _ratio_off_at_5(records):
    next(r for r in records if r["step"] == 5 and "score" in r)["first_ratio_dev"] = 2.0e-7
    return records


def _share_off_at_2(records):
    next(r for r in records if r["step"] == 2 and "score" in r)["generation_share"] *= 0.5
    return records


@pytest.mark.parametrize("edit, message", [
    (_drop_clip_frac_at_4, "step 4: missing ['clip_frac']"),
    (_swap_steps_3_and_4, "non-increasing at [3]"),
    (_ratio_off_at_5, "first_ratio_dev != 0 on an fp32 CPU run"),
    (_share_off_at_2, "generation_share != time_rollout_s"),
], ids=["missing_key", "steps_not_increasing", "first_ratio_not_1", "time_split"])
def test_broken_metrics_fail(ppo_run, kernel_name, monkeypatch, tmp_path, edit, message):
    broken = edited_copy(ppo_run, tmp_path / "broken", edit)
    with pytest.raises(CellExecutionError) as error:
        execute(broken, kernel_name, monkeypatch)
    assert error.value.ename == "AssertionError" and message in error.value.evalue, error.value.evalue


def test_ratio_deviation_off_fp32_cpu_is_flagged(ppo_run, kernel_name, monkeypatch, tmp_path):
    def bf16(config):
        config["run_metadata"]["precision"] = "bf16"

    nb = execute(edited_copy(ppo_run, tmp_path / "bf16", _ratio_off_at_5, bf16), kernel_name, monkeypatch)
    assert "FLAG: first_ratio_dev != 0 at 1 steps (max 2e-07)" in printed(nb), printed(nb)
