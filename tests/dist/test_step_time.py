"""Where each step's time goes, on 2 real gloo ranks, by injection (LLMTRAIN_TEST_FAULT sleep faults, faults.py):
every rank's loader sleeps 0.25 s a step, rank 1 sleeps 0.15 s after each step, and each checkpoint save (every 3
steps) sleeps 0.3 s. One run of the tiny SFT recipe; from it: the parts add up to the step time, each delay lands in
its part, the slow rank is named (log and metrics), and the doctor names the loader, the rank and the save's period.
"""

from __future__ import annotations

import statistics

import pytest

from llmtrain.doctor import diagnose_run
from tests.helpers import assert_ok, cli_env, read_metrics, run_cli

pytestmark = pytest.mark.dist

PHASES = ("data", "compute", "optim", "comm", "ckpt", "eval", "other")
FAULTS = "sleep=0.25,at=data;sleep=0.15,at=step,rank=1;sleep=0.3,at=save"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_time")
    result = run_cli(["recipe=sft_tiny", "trainer.max_steps=12", "trainer.save_every_n_steps=3",
                      "trainer.eval_every_n_steps=0", "trainer.log_every_n_steps=2", "trainer.straggler_windows=2",
                      "trainer.straggler_threshold=0.1",
                      "data.eval_files=[]", "data.eval_fraction=0", f"output_dir={out}"],
                     nproc=2, env=cli_env(LLMTRAIN_TEST_FAULT=FAULTS), timeout=300)
    assert_ok(result)
    return out, read_metrics(out)[0], result.stderr


def test_the_parts_add_up_and_each_delay_lands_in_its_part(run):
    _, rows, _ = run
    assert [r["step"] for r in rows] == list(range(1, 13))
    for r in rows:
        parts = [r[f"time_{p}_s"] for p in PHASES]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(r["step_time_s"], rel=1e-9, abs=1e-12)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"])
        assert 0.25 <= r["time_data_s"] < 0.4  # the loader's sleep, every step
    # the saves after steps 3, 6, 9 are in the next rows (12's is after the last row); nothing else saves
    assert [r["step"] for r in rows if r["time_ckpt_s"] > 0] == [4, 7, 10]
    assert min(r["time_ckpt_s"] for r in rows if r["time_ckpt_s"] > 0) >= 0.3
    # rank 0 waits for rank 1's 0.15 s in a collective: exposed communication; its own `other` stays small
    assert statistics.median(r["time_comm_s"] for r in rows[1:]) > 0.1
    step = statistics.median(r["step_time_s"] for r in rows)
    assert statistics.median(r["time_other_s"] for r in rows) < 0.05 * step


def test_the_slow_rank_is_named_with_its_part(run):
    _, rows, stderr = run
    windows = [r for r in rows if "straggler_rank" in r]
    assert [r["step"] for r in windows] == list(range(2, 13, 2))
    for w in windows[1:]:  # rank 1's sleep (after step 1 on: from the second window) is its own, rank 0 waits it out
        assert w["time_r1_other_s"] >= 0.15 and w["time_r0_comm_s"] > 0.1 > w["time_r1_comm_s"]
        assert w["time_r1_busy_s"] == pytest.approx(w["time_r1_step_s"] - w["time_r1_comm_s"])
    assert windows[-1]["straggler_rank"] == 1 and windows[0]["straggler_rank"] == -1  # after 2 windows in a row
    assert "rank 1 is a straggler" in stderr and "its excess is in other" in stderr


def test_the_doctor_names_the_loader_the_rank_and_the_saves(run):
    out, _, stderr = run
    diagnosis = diagnose_run(out)
    found = {(f.kind, f.cause): f for f in diagnosis.findings}
    data, rank, save = found["steady", "data"], found["slow_rank", "rank 1"], found["periodic", "ckpt"]
    assert diagnosis.dominant is data and 0.25 <= data.figures["median_s"] < 0.4
    assert rank.figures["part"] == "other" and rank.figures["busy_s"] - rank.figures["median_s"] > 0.1
    assert save.figures["period"] == 3 and save.figures["steps"] == [3, 6, 9] and save.figures["each_s"] >= 0.3
    assert "doctor: dominant: data loader wait" in stderr  # the run's end summary
