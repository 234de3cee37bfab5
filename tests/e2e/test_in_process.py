"""`llmtrain.run.run` in a process that goes on after it (a sweep, a notebook, tests/dist/workers/batched_runs.py):
the run leaves nothing of itself behind."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import PYTHON, REPO, cli_env

pytestmark = pytest.mark.e2e

AFTER_A_RUN = """
import multiprocessing, sys
from llmtrain.compose import compose_config
from llmtrain.run import run
run(compose_config(sys.argv[1:]))
print("children after the run:", len(multiprocessing.active_children()))
"""


def test_a_run_leaves_no_data_loader_workers_behind(tmp_path):
    """data.num_workers=2 keeps its workers for the whole run (persistent): they stop when the run returns."""
    result = subprocess.run([PYTHON, "-c", AFTER_A_RUN, "recipe=sft_tiny", "trainer.max_steps=2", "data.num_workers=2",
                             "trainer.eval_every_n_steps=0", "data.eval_files=[]", "trainer.save_every_n_steps=0",
                             f"output_dir={tmp_path / 'run'}"], env=cli_env(), cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "children after the run: 0" in result.stdout, (result.stdout[-1000:], result.stderr[-2000:])
