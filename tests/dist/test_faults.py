"""Faults under the real launchers, with real signals (2 CPU ranks, gloo): a rank killed (torchrun restarts every
rank from the newest checkpoint), SIGTERM to one rank or to torchrun (all save one step, exit 0, resume bitwise),
a stalled rank (the job ends after trainer.collective_timeout_s), a rank killed inside a save.

Faults fire at an exact step through LLMTRAIN_TEST_FAULT (llmtrain/faults.py): the process sends the signal
itself (or to its parent, torchrun), only in torchrun's first attempt. Every run is compared with one straight
run of the same 12 steps (checkpoints every 5).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, assert_ok, cli_env, read_metrics

pytestmark = pytest.mark.dist

ARGS = ["recipe=sft_tiny", "trainer.max_steps=12", "trainer.save_every_n_steps=5", "trainer.keep_last_k=3",
        "trainer.eval_every_n_steps=0", "trainer.log_every_n_steps=0", "data.eval_files=[]", "data.eval_fraction=0"]


def launch_env(**extra: str) -> dict:
    return cli_env(NPROC="2", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra)


def run_group(cmd: list[str], env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a launcher in its own session; on a timeout kill the whole session (launcher and ranks: a stuck rank
    must not outlive the test)."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def torchrun_sh(out: Path, *extra: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return run_group(["bash", str(REPO / "launch" / "torchrun.sh"), *ARGS, *extra, f"output_dir={out}"],
                     launch_env(**env), timeout)


def train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)[0]]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)[0]}


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "straight"
    assert_ok(torchrun_sh(out))
    assert train_steps(out) == list(range(1, 13))
    return out


def test_killed_rank_restarts_every_rank_from_the_last_checkpoint(straight, tmp_path):
    """SIGKILL of rank 1 after step 7, torchrun --max-restarts 1: every rank restarts from step_5, the job
    finishes with the straight run's losses, and metrics.jsonl has each step once (6 and 7 were replayed)."""
    out = tmp_path / "run"
    result = torchrun_sh(out, MAX_RESTARTS="1", LLMTRAIN_TEST_FAULT="rank=1,step=7,signal=KILL")
    assert_ok(result)
    assert "test fault: SIGKILL to self at step 7" in result.stderr
    # rank 0 does not wait for a timeout: its next collective fails at once (the dead rank's connection closed)
    assert "llmtrain: error on rank 0: step 7: a collective did not complete while agreeing whether to stop" in \
        result.stderr
    assert f"resumed from {out}/checkpoints/step_5 at step 5" in result.stderr, result.stderr[-3000:]
    assert train_steps(out) == list(range(1, 13))
    assert losses(out) == losses(straight)
    assert (out / "hf" / "config.json").is_file()


def stopped_at(stderr: str, nproc: int = 2) -> int:
    """The step every rank says it stopped at (they must agree)."""
    steps = {int(line.split("stopped at step ")[1].split()[0]) for line in stderr.splitlines()
             if "stopped at step " in line}
    assert stderr.count("stopped at step ") == nproc and len(steps) == 1, stderr[-3000:]
    return steps.pop()


def assert_resumes_bitwise(out: Path, straight: Path, step: int) -> None:
    """The stopped run holds step_<step> as latest and no export; a plain restart finishes it bit for bit."""
    assert latest(out) == f"step_{step}" and not (out / "hf").exists()
    assert train_steps(out) == list(range(1, step + 1))
    again = torchrun_sh(out)
    assert_ok(again)
    assert f"resumed from {out}/checkpoints/step_{step} at step {step}" in again.stderr
    assert train_steps(out) == list(range(1, 13))
    assert losses(out) == losses(straight)


def test_sigterm_to_one_rank_saves_the_same_step_on_every_rank_and_exits_0(straight, tmp_path):
    """With trainer.async_save=true: the stop path waits for the background write and makes step_6 complete and
    `latest` before exiting (the launcher's SIGTERM test below saves synchronously)."""
    out = tmp_path / "run"
    result = torchrun_sh(out, "trainer.async_save=true", LLMTRAIN_TEST_FAULT="rank=1,step=6,signal=TERM")
    assert_ok(result)  # every rank exited 0, so torchrun did too (and restarted nothing)
    assert "SIGTERM received: saving a checkpoint at the end of this step" in result.stderr
    assert stopped_at(result.stderr) == 6
    assert_resumes_bitwise(out, straight, 6)


def test_sigterm_to_torchrun_is_forwarded_every_rank_saves_and_exits_0(straight, tmp_path):
    """torchrun gets SIGTERM (rank 1 sends it to its parent after step 6, as SLURM would): it forwards it to every
    rank, which save one agreed step and exit 0 within the shutdown timeout; torchrun itself reports the signal."""
    out = tmp_path / "run"
    result = torchrun_sh(out, LLMTRAIN_TEST_FAULT="rank=1,step=6,signal=TERM,target=launcher")
    step = stopped_at(result.stderr)
    assert 6 <= step < 12, result.stderr[-3000:]
    assert result.returncode != 0 and "Received 15 death signal, shutting down workers" in result.stderr
    assert "forcefully exiting via 9" not in result.stderr  # no rank needed killing after its save
    assert_resumes_bitwise(out, straight, step)


def test_a_stalled_rank_ends_the_job_after_the_collective_timeout(tmp_path):
    """Rank 1 stops itself (SIGSTOP) after step 3: rank 0's next collective times out after
    trainer.collective_timeout_s, it exits 4 naming its rank, the step and the collective, and torchrun kills
    the stalled rank: SIGTERM stays pending on a stopped process, so that takes torch's fixed 30 s grace for a
    failed worker group (--shutdown-timeout only applies to signals sent to torchrun)."""
    timeout_s, shutdown_s = 15, 30
    proc = subprocess.Popen(["bash", str(REPO / "launch" / "torchrun.sh"), *ARGS, f"output_dir={tmp_path / 'run'}",
                             f"trainer.collective_timeout_s={timeout_s}"], cwd=REPO, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env=launch_env(MAX_RESTARTS="0",
                                           LLMTRAIN_TEST_FAULT="rank=1,step=3,signal=STOP"))
    stderr, stalled = [], []

    def read() -> None:
        for line in proc.stderr:
            stderr.append(line)
            if "test fault: SIGSTOP" in line:
                stalled.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=180)
        ended = time.monotonic()
    except subprocess.TimeoutExpired:
        pytest.fail("the job did not end: " + "".join(stderr)[-3000:])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks, also the stopped one
    reader.join(timeout=10)
    ended_after, text = ended - stalled[0], "".join(stderr)
    assert proc.returncode != 0
    assert "llmtrain: error on rank 0: step 3: a collective did not complete while agreeing whether to stop" in text
    assert f"trainer.collective_timeout_s={timeout_s} s" in text and "Timed out" in text
    assert timeout_s - 1 <= ended_after <= timeout_s + shutdown_s + 25, (ended_after, text[-3000:])


def test_a_save_cut_short_is_ignored_and_the_previous_checkpoint_resumes(straight, tmp_path):
    """Rank 0 is SIGKILLed inside the save of step 10 (every rank's files written, no COMPLETE, not renamed):
    torchrun restarts every rank, which resume from step_5 (the torn folder is not a checkpoint, `latest` still
    names step_5); the rerun saves step_10 over the leftovers and matches the straight run."""
    out = tmp_path / "run"
    result = torchrun_sh(out, MAX_RESTARTS="1", LLMTRAIN_TEST_FAULT="rank=0,step=10,signal=KILL,at=save")
    assert_ok(result)
    assert "test fault: SIGKILL to self at save 10" in result.stderr
    assert f"resumed from {out}/checkpoints/step_5 at step 5" in result.stderr, result.stderr[-3000:]
    assert train_steps(out) == list(range(1, 13)) and losses(out) == losses(straight)
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_10", "step_12", "step_5"]
    assert json.loads((checkpoints / "step_10" / "trainer.json").read_text())["parent"] == "step_5"


def test_a_kill_during_a_background_write_keeps_the_previous_checkpoint_and_resumes_from_it(straight, tmp_path):
    """trainer.async_save=true: rank 0 is SIGKILLed on the thread writing step 10 (its files written, training on
    at step 11, no restart): step_10 is only the hidden temp folder, step_5 is complete and `latest`; a plain
    relaunch resumes from step_5 and matches the straight (synchronous) run bit for bit."""
    out = tmp_path / "run"
    crashed = torchrun_sh(out, "trainer.async_save=true", MAX_RESTARTS="0",
                          LLMTRAIN_TEST_FAULT="rank=0,step=10,signal=KILL,at=write")
    assert crashed.returncode != 0 and "test fault: SIGKILL to self at write 10" in crashed.stderr
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp_step_10", "latest", "step_5"]
    assert (checkpoints / ".tmp_step_10" / "engines" / "policy" / "model.pt").is_file()  # written, never made visible
    assert latest(out) == "step_5" and (checkpoints / "step_5" / "COMPLETE").is_file()
    again = torchrun_sh(out, "trainer.async_save=true")
    assert_ok(again)
    assert f"resumed from {out}/checkpoints/step_5 at step 5" in again.stderr, again.stderr[-3000:]
    assert losses(out) == losses(straight) and train_steps(out) == list(range(1, 13))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_10", "step_12", "step_5"]


def test_deepspeed_launcher_trains_stops_on_sigterm_and_resumes_bitwise(straight, tmp_path):
    """launch/deepspeed.sh (2 CPU ranks, backend ddp as in the straight run): SIGTERM to rank 1 after step 6 ->
    both save step 6 and exit 0; the rerun (resume=auto added by the script) matches the torchrun run bit for bit."""
    out = tmp_path / "run"

    def deepspeed_sh(**env: str) -> subprocess.CompletedProcess:
        return run_group(["bash", str(REPO / "launch" / "deepspeed.sh"), *ARGS, f"output_dir={out}"], launch_env(**env))

    first = deepspeed_sh(LLMTRAIN_TEST_FAULT="rank=1,step=6,signal=TERM")
    assert_ok(first)
    assert stopped_at(first.stderr) == 6 and latest(out) == "step_6"
    again = deepspeed_sh()
    assert_ok(again)
    assert f"resumed from {out}/checkpoints/step_6 at step 6" in again.stderr
    assert train_steps(out) == list(range(1, 13)) and losses(out) == losses(straight)
