"""`ruff check` on the whole repo (llmtrain/, tests/, benchmarks/, notebooks/) with pyproject's [tool.ruff]: the
rules and their reasons are there. ruff is in the dev extra, so a missing ruff fails rather than skips."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.helpers import REPO


def test_ruff_check_passes():
    assert importlib.util.find_spec("ruff") is not None, 'ruff is not installed: pip install -e ".[dev]"'
    # --no-cache: nothing written into the checkout; the config is found from cwd (pyproject.toml)
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"ruff check found problems (`ruff check --fix .` fixes those marked [*]):\n{result.stdout[-8000:]}"
        f"{result.stderr[-2000:]}")
