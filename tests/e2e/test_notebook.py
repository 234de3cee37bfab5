"""notebooks/loss_inspection.ipynb executed with nbclient: on a fresh tiny run it passes its own checks and
summarises the losses; on broken copies of that run's metrics.jsonl it fails (or flags what it should)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from tests.conftest import REPO, assert_ok, read_metrics, run_cli
from tests.e2e.notebooks import execute as run_notebook
from tests.e2e.notebooks import kernel_name, printed, test_stored_without_outputs  # noqa: F401  (fixture, test)

pytestmark = pytest.mark.e2e

NOTEBOOK = REPO / "notebooks" / "loss_inspection.ipynb"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("nb") / "run"
    result = run_cli(["recipe=sft_tiny", "trainer.max_steps=20", "trainer.eval_every_n_steps=10",
                      f"output_dir={run_dir}"])
    assert_ok(result)
    return run_dir


def execute(run_dir: Path, kernel_name: str, monkeypatch) -> nbformat.NotebookNode:
    return run_notebook(NOTEBOOK, run_dir, kernel_name, monkeypatch)


def broken_copy(run_dir: Path, dest: Path, edit) -> Path:
    """metrics.jsonl (train records edited by `edit(list) -> list`, eval records kept) and config.yaml."""
    dest.mkdir()
    shutil.copy(run_dir / "config.yaml", dest / "config.yaml")
    train, evals = read_metrics(run_dir)
    records = sorted(edit([dict(r) for r in train]) + evals, key=lambda r: (r["step"], "loss" in r))
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return dest


def test_summarises_a_fresh_run(tiny_run, kernel_name, monkeypatch):
    train, evals = read_metrics(tiny_run)
    nb = execute(tiny_run, kernel_name, monkeypatch)

    summary = " ".join(printed(nb, "summary").split())  # undo the notebook's line wrapping
    assert f"{train[0]['loss']:.4f} at step 1" in summary, summary
    assert f"{train[-1]['loss']:.4f} at step 20" in summary, summary
    best = min(evals, key=lambda r: r["eval_loss"])
    assert f"Best eval loss {best['eval_loss']:.4f} at step {best['step']}" in summary, summary
    assert "non-finite loss or grad norm: 0;" in summary, summary
    assert "consistent: steps 1..20, 0 skipped, 3 evaluations at steps [0, 10, 20]" in printed(nb)

    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not images and "tables instead of plots" in printed(nb)
    else:
        assert len(images) == 1


def _drop_step_7(train):
    return [r for r in train if r["step"] != 7]


def _uncounted_nan(train):
    train[4]["loss"] = float("nan")  # step 5, skipped_steps left at 0
    return train


@pytest.mark.parametrize("edit, message", [(_drop_step_7, "missing [7]"),
                                           (_uncounted_nan, "non-finite loss at steps [5] not counted")],
                         ids=["missing_step", "uncounted_nan"])
def test_broken_metrics_fail(tiny_run, kernel_name, monkeypatch, tmp_path, edit, message):
    broken = broken_copy(tiny_run, tmp_path / "broken", edit)
    with pytest.raises(CellExecutionError) as error:
        execute(broken, kernel_name, monkeypatch)
    assert error.value.ename == "AssertionError" and message in error.value.evalue, error.value.evalue


def test_counted_skip_passes_and_spike_is_flagged(tiny_run, kernel_name, monkeypatch, tmp_path):
    def edit(train):
        train[11].update(loss=float("nan"), grad_norm=float("nan"))  # step 12, skipped as the trainer would
        for r in train[11:]:
            r["skipped_steps"] = 1
        train[15]["loss"] *= 3  # step 16
        return train

    nb = execute(broken_copy(tiny_run, tmp_path / "skipped", edit), kernel_name, monkeypatch)
    assert "2 flagged steps: [12, 16]" in printed(nb), printed(nb)
    summary = " ".join(printed(nb, "summary").split())
    assert "non-finite loss or grad norm: 1; 1 loss spikes" in summary, summary


def test_cost_notebook_puts_the_plan_next_to_the_run(tiny_run, kernel_name, monkeypatch):
    """notebooks/cost.ipynb on the same fresh run: the planner's table for every backend, the run's measured model
    states and activations next to its row (errors printed), the throughput, and cost.png written."""
    nb = run_notebook(REPO / "notebooks" / "cost.ipynb", tiny_run, kernel_name, monkeypatch)
    text = printed(nb)
    for backend in ("ddp", "zero2", "zero3", "fsdp2"):
        assert f"{backend}: fits at micro-batch" in text, backend
    first = read_metrics(tiny_run)[0][0]
    error = first["memory_r0_activations"] / first["memory_r0_plan_activations"] - 1
    assert "activations r0" in text and f"({error:+.2%})" in text
    assert "tokens/s over steps 3..20" in printed(nb, "summary")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "tables instead of plots" in text
    else:
        assert (tiny_run / "cost.png").stat().st_size > 0
