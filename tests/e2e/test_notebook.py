"""notebooks/loss_inspection.ipynb executed with nbclient: on a fresh tiny run it passes its own checks and
summarises the losses; on broken copies of that run's metrics.jsonl it fails (or flags what it should); with a
LoRA run of the same recipe it overlays both. cost.ipynb and sft_token_loss.ipynb read the same run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient.exceptions import CellExecutionError

from tests.e2e.notebooks import edited_copy, last_eval_edited, printed
from tests.e2e.notebooks import execute as run_notebook
from tests.helpers import REPO, assert_ok, read_metrics, run_cli_jobs

pytestmark = pytest.mark.e2e

NOTEBOOK = REPO / "notebooks" / "loss_inspection.ipynb"
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.e2e
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The full run (run/) and a LoRA run (lora/) of sft_tiny, side by side (one CPU core each)."""
    root = tmp_path_factory.mktemp("nb")
    common = ["recipe=sft_tiny", "trainer.max_steps=20", "trainer.eval_every_n_steps=10"]
    results = run_cli_jobs({"run": {"args": [*common, f"output_dir={root / 'run'}"]},
                            "lora": {"args": [*common, "peft=lora", "optim.lr=1e-2", f"output_dir={root / 'lora'}"]}})
    for result in results.values():
        assert_ok(result)
    return root


@pytest.fixture(scope="module")
def tiny_run(runs) -> Path:
    return runs / "run"


@pytest.fixture(scope="module")
def lora_run(runs) -> Path:
    return runs / "lora"


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
        assert len(images) == 2  # the curves; the overlay of one run


def test_overlays_a_lora_run_by_step_and_by_tokens_seen(tiny_run, lora_run, kernel_name, monkeypatch):
    """LLMTRAIN_COMPARE_RUN_DIRS adds runs: one row each (labelled with backend and peft), every evaluation placed
    at the target tokens trained on before it (the sum of the train records' tokens up to its step)."""
    monkeypatch.setenv("LLMTRAIN_COMPARE_RUN_DIRS", str(lora_run))
    nb = execute(tiny_run, kernel_name, monkeypatch)
    table = printed(nb, "overlay")
    for run_dir, label in ((tiny_run, "run (ddp)"), (lora_run, "lora (ddp, lora)")):
        train, evals = read_metrics(run_dir)
        row = next(line for line in table.splitlines() if line.strip().startswith(label))
        seen = {0: 0, **{r["step"]: sum(t["tokens"] for t in train if t["step"] <= r["step"]) for r in evals}}
        points = " ".join(f"{seen[r['step']]}:{r['eval_loss']:.4f}" for r in evals)
        assert row.rstrip().endswith(points), (row, points)
        assert f" {sum(t['tokens'] for t in train)} " in row, row
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tiny_run / "loss_overlay.png").stat().st_size > 0


def test_sft_token_loss_recomputes_the_runs_eval_loss(tiny_run, kernel_name, monkeypatch):
    """sft_token_loss.ipynb rescores every held-out sample with the export: the token-weighted loss is the run's
    last eval loss (which it asserts), samples are listed worst first, and every sample is written coloured."""
    _, evals = read_metrics(tiny_run)
    nb = run_notebook(REPO / "notebooks" / "sft_token_loss.ipynb", tiny_run, kernel_name, monkeypatch)
    text = printed(nb)
    assert (f"matches the run: eval_loss {evals[-1]['eval_loss']:.6f} over {evals[-1]['eval_tokens']} target tokens "
            f"at step 20") in text, text
    # the summary wraps to the terminal's width (a pytest-xdist worker's differs), at a space or after a hyphen
    summary = re.sub(r"-\s+", "-", " ".join(printed(nb, "summary").split()))
    assert f"token-weighted loss {evals[-1]['eval_loss']:.4f}" in summary, summary
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["sample", "mean_loss"])
    worst = [float(line.split()[1]) for line in lines[header + 1:header + 9]]
    assert worst == sorted(worst, reverse=True), worst
    eval_file = yaml.safe_load((tiny_run / "config.yaml").read_text())["data"]["eval_files"][0]
    samples = len(Path(eval_file).read_text().splitlines())
    assert f"{samples} held-out samples" in text
    assert (tiny_run / "token_loss.html").read_text().count("<b>sample ") == samples


def test_sft_token_loss_fails_when_the_export_is_not_what_the_run_evaluated(tiny_run, kernel_name, monkeypatch,
                                                                          tmp_path):
    drifted = last_eval_edited(eval_loss=read_metrics(tiny_run)[1][-1]["eval_loss"] + 0.01)
    broken = edited_copy(tiny_run, tmp_path / "drifted", drifted)
    with pytest.raises(CellExecutionError) as error:
        run_notebook(REPO / "notebooks" / "sft_token_loss.ipynb", broken, kernel_name, monkeypatch)
    assert error.value.ename == "AssertionError" and "!= the run's eval_loss" in error.value.evalue


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
