"""notebooks/loss_inspection.ipynb executed with nbclient: on a fresh tiny run it passes its own checks and
summarises the losses; on broken copies of that run's metrics.jsonl it fails (or flags what it should)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests.conftest import REPO, assert_ok, read_metrics, run_cli

pytestmark = pytest.mark.e2e

NOTEBOOK = REPO / "notebooks" / "loss_inspection.ipynb"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("nb") / "run"
    result = run_cli(["recipe=sft_tiny", "trainer.max_steps=20", "trainer.eval_every_n_steps=10",
                      f"output_dir={run_dir}"])
    assert_ok(result)
    return run_dir


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
    """'python3' where that kernelspec starts this interpreter, else a throwaway kernelspec that does."""
    try:
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except NoSuchKernel:
        argv0 = None
    # jupyter_client itself replaces a bare python/python3/python3.X with sys.executable.
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    if argv0 in bare or (argv0 and _prefix_of(argv0) == sys.prefix):
        return "python3"
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(tmp_path / "kernels" / "llmtrain-test")  # argv[0] is sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "llmtrain-test"


def _prefix_of(python: str) -> str | None:
    try:
        result = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                                timeout=30)
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def execute(run_dir: Path, kernel_name: str, monkeypatch) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.setenv("LLMTRAIN_RUN_DIR", str(run_dir))  # the kernel inherits this process's environment
    NotebookClient(nb, kernel_name=kernel_name, timeout=120,
                   resources={"metadata": {"path": str(REPO)}}).execute()
    return nb


def printed(nb: nbformat.NotebookNode, tag: str | None = None) -> str:
    cells = [c for c in nb.cells if c.cell_type == "code" and (tag is None or tag in c.metadata.get("tags", []))]
    assert cells, f"no code cell tagged {tag!r}"
    return "".join(o.get("text", "") for c in cells for o in c.outputs if o.output_type == "stream")


def broken_copy(run_dir: Path, dest: Path, edit) -> Path:
    """metrics.jsonl (train records edited by `edit(list) -> list`, eval records kept) and config.yaml."""
    dest.mkdir()
    shutil.copy(run_dir / "config.yaml", dest / "config.yaml")
    train, evals = read_metrics(run_dir)
    records = sorted(edit([dict(r) for r in train]) + evals, key=lambda r: (r["step"], "loss" in r))
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return dest


def test_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


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
