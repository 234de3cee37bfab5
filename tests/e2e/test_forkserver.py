"""tests/forkserver.py: a run forked from the server is the run a cold `python -m llmtrain` makes (output, files,
exit status), only without the imports; a run it must not serve starts cold; a timeout kills the run."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.forkserver import CLIENT, serves
from tests.helpers import PYTHON, REPO, cli_env, run_cli

pytestmark = pytest.mark.e2e


def _cold(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "llmtrain", *args], env=env or cli_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def _forked(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    result = CLIENT.run(["llmtrain", *args], env=env or cli_env(), cwd=REPO, timeout=timeout)
    assert result is not None, "the forkserver did not serve a run in the tests' own environment"
    return result


def _steady(text: str, run_dir) -> str:
    """TEXT without what differs between two runs of one config: numbers (timings), dates, the run folder."""
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text.replace(str(run_dir), "RUN"))


def test_a_forked_run_prints_writes_and_exits_as_a_cold_one(tmp_path):
    args = ["recipe=sft_tiny", "trainer.max_steps=4", "trainer.eval_every_n_steps=2"]
    cold, forked = _cold([*args, f"output_dir={tmp_path / 'cold'}"]), _forked([*args, f"output_dir={tmp_path / 'f'}"])
    assert cold.returncode == forked.returncode == 0, forked.stderr[-3000:]
    assert _steady(forked.stdout, tmp_path / "f") == _steady(cold.stdout, tmp_path / "cold")
    assert _steady(forked.stderr, tmp_path / "f") == _steady(cold.stderr, tmp_path / "cold")

    def losses(run_dir):
        return [json.loads(line).get("loss") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    assert losses(tmp_path / "f") == losses(tmp_path / "cold")


def test_a_refusal_keeps_its_exit_code_and_message():
    args = ["recipe=sft_tiny", "trainer.max_stepz=3"]
    cold, forked = _cold(args), _forked(args)
    assert forked.returncode == cold.returncode == 2
    assert forked.stderr == cold.stderr and "trainer.max_stepz" in forked.stderr


def test_a_timeout_kills_the_run(tmp_path):
    start = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        _forked(["recipe=sft_tiny", "trainer.max_steps=100000", f"output_dir={tmp_path / 'run'}"], timeout=8)
    assert time.time() - start < 30
    assert _forked(["recipe=nope"]).returncode == 2  # the server still serves after it


def test_only_runtime_variables_may_differ_from_the_servers_environment():
    base = cli_env()
    assert serves(base, {**base, "LLMTRAIN_TEST_FAULT": "rank=0,step=2,kind=bad_batch", "WANDB_MODE": "disabled"})
    for changed in ({"PYTHONPATH": "/elsewhere"}, {"OMP_NUM_THREADS": "2"}, {"HF_TOKEN": "x"}):
        assert not serves(base, {**base, **changed}), changed
    assert not serves(base, {k: v for k, v in base.items() if k != "PATH"})


def test_run_cli_forks_where_it_may_and_starts_cold_where_it_must(tmp_path):
    before = CLIENT.forked
    assert run_cli(["recipe=nope"]).returncode == 2
    assert CLIENT.forked == before + 1
    assert run_cli(["recipe=nope"], env=cli_env(PYTHONPATH=str(tmp_path))).returncode == 2
    assert CLIENT.forked == before + 1
