"""The README's two commands: CI runs the same set-up, and the tiny recipe learns as the README says."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.helpers import REPO, assert_ok, read_metrics, run_cli

pytestmark = pytest.mark.e2e


def readme_commands() -> list[str]:
    block = re.search(r"## Set up and run \(two commands\).*?```bash\n(.*?)```", (REPO / "README.md").read_text(),
                      re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_setup_and_test_command():
    setup_and_run, setup_and_test = readme_commands()
    ci = (REPO / ".ci" / "run").read_text()
    for step in ["pip install torch==2.13.0", 'pip install -e ".[dev,deepspeed,peft]"']:
        assert step in setup_and_run and step in setup_and_test
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q -e ".[dev,deepspeed,peft]"' in ci
    test_command = setup_and_test.split("&&")[-1].strip()
    assert test_command in ci


def test_readme_tiny_recipe_learns(tmp_path: Path):
    """Runs the README's main job as written (from a fresh working directory) and checks its claims."""
    job = shlex.split(readme_commands()[0].split("&&")[-1].strip())
    assert job[:3] == ["python", "-m", "llmtrain"]
    assert_ok(run_cli(job[3:], cwd=tmp_path))
    train, evals = read_metrics(tmp_path / "runs" / "sft_tiny")
    assert len(train) == 500 and evals[0]["step"] == 0 and evals[-1]["step"] == 500
    first, last = evals[0], evals[-1]
    assert last["eval_loss"] < 0.1 * first["eval_loss"]  # README: 5.52 -> 0.19
    assert first["eval_accuracy"] < 0.05 and last["eval_accuracy"] > 0.85  # README: 0.7 % -> 93.6 %
    assert (tmp_path / "runs" / "sft_tiny" / "hf" / "model.safetensors").is_file()
