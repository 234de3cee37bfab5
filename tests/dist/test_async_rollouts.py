"""ppo.off_policy.max_staleness=1 through the session's vLLM server (tests/conftest.py), GRPO on 2 ranks: the engine
samples iteration i + 1's rollout on version i − 1 while iteration i trains. One uninterrupted run and one resumed
from its step-1 checkpoint (the rollout in flight there saved with it): the staleness and versions the run logs, the
engine's version after the last sync, the update's ratio against the proximal policy, and a bitwise resume."""

from __future__ import annotations

import pytest

from llmtrain.stages.ppo.engines.http import call
from tests.helpers import read_metrics, run_cli, vllm_grpo_args

pytestmark = pytest.mark.dist

STEPS = 3


def test_rollouts_one_version_stale_train_and_resume_bitwise(vllm_server, tmp_path):
    engine = [f"ppo.rollout.vllm.urls=[{vllm_server.url}]", "ppo.off_policy.max_staleness=1",
              f"trainer.max_steps={STEPS}", f"trainer.eval_every_n_steps={STEPS}", "trainer.save_every_n_steps=1",
              "trainer.keep_last_k=3"]
    straight = run_cli(vllm_grpo_args(tmp_path / "straight", *engine), nproc=2, timeout=900)
    assert straight.returncode == 0, straight.stderr[-4000:]
    # the last sync was the final eval's (policy-3), which first let iteration 4's requests finish on policy-2
    assert call(vllm_server.url, "/weight_info")["weight_version"] == f"policy-{STEPS}"
    resumed = run_cli(vllm_grpo_args(tmp_path / "resumed", *engine,
                                f"resume={tmp_path / 'straight' / 'checkpoints' / 'step_1'}"), nproc=2, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    train, evals = read_metrics(tmp_path / "straight")
    assert [r["step"] for r in evals] == [0, STEPS]
    # iteration 1 trains what version 0 sampled; each later one what the version before its own sampled
    assert [r["staleness_max"] for r in train] == [0.0, 1.0, 1.0]
    assert [r["rollout_version"] for r in train] == [0.0, 0.0, 1.0]
    # the step-0 eval pushed version 0: iteration 1 needs no sync, every later one pushes the weights it starts from
    assert "sync_max_abs" not in train[0] and all(r["sync_max_abs"] <= 1e-3 for r in train[1:]), train
    assert all(r["trainer_wait_s"] >= 0 and r["engine_idle_s"] >= 0 for r in train)
    # the clipped ratio is against the proximal policy (the experience's forward): exactly 1 at the first mini-batch;
    # the behaviour policy is a version behind from iteration 2 on, which the mismatch measures and the weights correct
    assert all(r["first_ratio_dev"] == 0.0 for r in train), train
    assert train[0]["mismatch_logp_abs_max"] < 1e-3 < train[1]["mismatch_logp_abs_max"], train
    assert all("mismatch_is_ratio_mean" in r for r in train)

    keys = ("score", "loss", "grad_norm", "response_len", "mismatch_logp_abs_max", "staleness_max", "rollout_version",
            "mismatch_is_ratio_mean")
    again = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in again[0]] == [2, 3]
    assert [{k: r[k] for k in keys} for r in again[0]] == [{k: r[k] for k in keys} for r in train[1:]]
    assert again[1][-1]["eval_exact_match"] == evals[-1]["eval_exact_match"]
