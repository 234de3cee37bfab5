"""The launch scripts themselves: every one parses (bash -n, shellcheck when installed); two torchrun "nodes" on
loopback from NNODES/MASTER_ADDR/MASTER_PORT that restart together after a rank dies; the SLURM script under a fake
srun/scontrol (tests/dist/workers/fake_slurm) with SLURM variables set here: 2 nodes × 1 rank on loopback, SIGUSR1
ahead of the time limit -> every rank saves and stops, the script requeues the job, and the requeued job resumes
and finishes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, cli_env, read_metrics

pytestmark = pytest.mark.dist

SCRIPTS = sorted([*REPO.glob("launch/**/*.sh"), *REPO.glob("launch/**/*.sbatch"),
                  *(REPO / "tests/dist/workers/fake_slurm").iterdir()])
ARGS = ["recipe=sft_tiny", "trainer.eval_every_n_steps=0", "trainer.log_every_n_steps=0", "data.eval_files=[]",
        "data.eval_fraction=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_script_parses_and_passes_shellcheck(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run(["shellcheck", "-x", "-s", "bash", str(script)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout


def env_with(**extra: str) -> dict:
    return cli_env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra)


def test_two_torchrun_nodes_on_loopback_restart_together_after_a_rank_dies(tmp_path):
    """NNODES=2 × NPROC=1 from NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT, MAX_RESTARTS=1: rank 1 (the other node)
    is SIGKILLed after step 7; both agents start a new rendezvous round (a fresh store:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 from the script) and every rank resumes from step_5."""
    out, port = tmp_path / "run", str(free_port())
    nodes = [subprocess.Popen(["bash", str(REPO / "launch/torchrun.sh"), *ARGS, "trainer.max_steps=12",
                               "trainer.save_every_n_steps=5", f"output_dir={out}"], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env_with(NNODES="2", NODE_RANK=str(rank), NPROC="1", MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=port, RDZV_ID="loopback", MAX_RESTARTS="1",
                                           LLMTRAIN_TEST_FAULT="rank=1,step=7,signal=KILL"))
             for rank in (0, 1)]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    text = "\n".join(logs)
    assert [node.returncode for node in nodes] == [0, 0], text[-6000:]
    assert "world 2" in text and "test fault: SIGKILL to self at step 7" in text
    assert f"resumed from {out}/checkpoints/step_5 at step 5" in text
    assert [r["step"] for r in read_metrics(out)[0]] == list(range(1, 13))


def sbatch(out: Path, slurm_log: Path, restart: int, *extra: str) -> subprocess.Popen:
    env = env_with(SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[1-2]", GPUS_PER_NODE="1",
                   MASTER_PORT=str(free_port()), SLURM_RESTART_COUNT=str(restart), FAKE_SLURM_LOG=str(slurm_log))
    env["PATH"] = f"{REPO / 'tests/dist/workers/fake_slurm'}:{env['PATH']}"
    return subprocess.Popen(["bash", str(REPO / "launch/slurm/train.sbatch"), *ARGS, *extra, f"output_dir={out}"],
                            cwd=REPO, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_slurm_script_stops_on_the_time_limit_signal_requeues_and_the_requeued_job_resumes(tmp_path):
    out, slurm_log = tmp_path / "run", tmp_path / "scontrol.log"
    steps = ["trainer.max_steps=60", "trainer.save_every_n_steps=50"]
    job = sbatch(out, slurm_log, 0, *steps)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        assert job.poll() is None, job.stderr.read()[-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends to the batch script
    stderr = job.communicate(timeout=240)[1]
    assert job.returncode == 0, stderr[-3000:]
    assert "SIGUSR1 received: asking every rank to save and stop, then requeueing job 4242" in stderr
    assert slurm_log.read_text().splitlines() == ["requeue 4242"]
    stopped = {line.split("stopped at step ")[1].split()[0] for line in stderr.splitlines()
               if "stopped at step " in line}
    assert stderr.count("stopped at step ") == 2 and len(stopped) == 1, stderr[-3000:]
    step = int(stopped.pop())
    assert 3 <= step < 60 and (out / "checkpoints/latest").read_text().strip() == f"step_{step}"

    requeued = sbatch(out, slurm_log, 1, *steps)
    stderr = requeued.communicate(timeout=300)[1]
    assert requeued.returncode == 0, stderr[-3000:]
    assert f"resumed from {out}/checkpoints/step_{step} at step {step}" in stderr
    assert [r["step"] for r in read_metrics(out)[0]] == list(range(1, 61))
    assert slurm_log.read_text().splitlines() == ["requeue 4242"]  # finished: not requeued again
