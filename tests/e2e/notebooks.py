"""Running a notebook of notebooks/ in tests: the kernel to use, execution on a run directory, its printed output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient

from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


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


def execute(notebook: Path, run_dir: Path, kernel_name: str, monkeypatch) -> nbformat.NotebookNode:
    nb = nbformat.read(notebook, as_version=4)
    monkeypatch.setenv("LLMTRAIN_RUN_DIR", str(run_dir))  # the kernel inherits this process's environment
    NotebookClient(nb, kernel_name=kernel_name, timeout=120,
                   resources={"metadata": {"path": str(REPO)}}).execute()
    return nb


def printed(nb: nbformat.NotebookNode, tag: str | None = None) -> str:
    cells = [c for c in nb.cells if c.cell_type == "code" and (tag is None or tag in c.metadata.get("tags", []))]
    assert cells, f"no code cell tagged {tag!r}"
    return "".join(o.get("text", "") for c in cells for o in c.outputs if o.output_type == "stream")


@pytest.mark.e2e
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


def edited_copy(run_dir: Path, dest: Path, edit_records=None, edit_config=None) -> Path:
    """The run's metrics.jsonl (every record, in file order, through `edit_records(list) -> list`), config.yaml
    (through `edit_config(dict)`) and, linked, its export `hf/` when it has one."""
    import json

    import yaml

    dest.mkdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    records = edit_records(records) if edit_records else records
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    if edit_config:
        edit_config(config)
    (dest / "config.yaml").write_text(yaml.safe_dump(config))
    if (run_dir / "hf").is_dir():
        (dest / "hf").symlink_to(run_dir / "hf")
    return dest


def last_eval_edited(**changes):
    """An `edit_records` for edited_copy: the last eval record gets `changes`."""
    def edit(records: list[dict]) -> list[dict]:
        last_eval = max(i for i, r in enumerate(records) if any(k.startswith("eval_") for k in r))
        records[last_eval].update(changes)
        return records

    return edit
