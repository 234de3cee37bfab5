"""Running a notebook of notebooks/ in tests: execution on a run directory, its printed output, edited copies of a
run. Plain helpers for the e2e notebook tests; the kernel to run with is the `kernel_name` fixture
(tests/e2e/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.helpers import REPO


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
