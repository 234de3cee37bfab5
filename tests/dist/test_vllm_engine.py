"""Rollouts through a real vLLM server (one CPU server for the session, tests/conftest.py): GRPO samples through it on
DDP, FSDP2 (sharded weights gathered for the sync) and ZeRO-3 with LoRA (merged); after the updates the engine's
greedy tokens equal the trainer's exported model's, and it reports the version the run pushed last. A server that
llmtrain starts itself is stopped when the run ends, and when it dies mid-run the run stops naming it, the last
checkpoint intact. Bad engines are refused with the URL named."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from llmtrain.stages.ppo.engines.http import call
from tests.helpers import PYTHON, REPO, TOKENIZER_DIR, cli_env, read_metrics, run_cli, save_tiny_model, vllm_grpo_args

pytestmark = pytest.mark.dist

STEPS = 2


def grpo_args(out: Path, *extra: str) -> list[str]:
    return vllm_grpo_args(out, f"trainer.max_steps={STEPS}", f"trainer.eval_every_n_steps={STEPS}", *extra)


def trainer_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def engine_greedy(url: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    sampling = {"max_tokens": new_tokens, "temperature": 0.0, "detokenize": False, "ignore_eos": True}
    return [call(url, "/inference/v1/generate", {"token_ids": p, "sampling_params": sampling})["choices"][0]
            ["token_ids"] for p in prompts]


WORDS = ["reverse: stream\n", "reverse: abcdefg\n", "reverse: qz\n"]


def reversal_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    return [tokenizer(word)["input_ids"] for word in WORDS]


@pytest.mark.parametrize("nproc,backend", [(1, ["backend=ddp"]), (2, ["backend=fsdp2"]),
                                           (2, ["backend=zero3", "peft=lora", "peft.dropout=0.0",
                                                "ppo.old_logprobs=engine"])],
                         ids=["ddp", "fsdp2", "zero3-lora"])
def test_engine_samples_on_the_policys_weights_after_every_update(nproc, backend, vllm_server, tmp_path):
    result = run_cli(grpo_args(tmp_path / "run", f"ppo.rollout.vllm.urls=[{vllm_server.url}]", *backend),
                     nproc=nproc, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    train, evals = read_metrics(tmp_path / "run")
    assert [r["step"] for r in evals] == [0, STEPS]
    # every iteration after the first rollout synced (step 1's weights were pushed for the step-0 eval) and verified
    assert all(r["sync_max_abs"] <= 1e-3 for r in train if "sync_max_abs" in r)
    assert "sync_max_abs" in train[1], train[1]
    assert all(r["mismatch_logp_abs_max"] < 1e-3 for r in train), [r["mismatch_logp_abs_max"] for r in train]
    if "ppo.old_logprobs=engine" in backend:  # the ratio's old log-probs are the engine's: the first ratio measures it
        assert all(0 < r["first_ratio_dev"] == r["mismatch_logp_abs_max"] for r in train), train
    else:  # the experience's forward is the update's first: exactly 1
        assert all(r["first_ratio_dev"] == 0.0 for r in train), train
    assert call(vllm_server.url, "/weight_info")["weight_version"] == f"policy-{STEPS}"
    prompts = reversal_prompts()
    trained = trainer_greedy(tmp_path / "run" / "hf", prompts, 10)
    base = Path(yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["name_or_path"])
    initial = trainer_greedy(base, prompts, 10)
    assert trained != initial, "the updates did not change the greedy tokens: the check below would prove nothing"
    assert engine_greedy(vllm_server.url, prompts, 10) == trained


def test_a_resumed_run_samples_what_the_straight_run_sampled(vllm_server, tmp_path):
    engine = [f"ppo.rollout.vllm.urls=[{vllm_server.url}]", "trainer.eval_every_n_steps=0",
              "trainer.save_every_n_steps=1"]
    straight = run_cli(grpo_args(tmp_path / "straight", *engine))
    first = run_cli(grpo_args(tmp_path / "resumed", *engine, "trainer.max_steps=1"))
    resumed = run_cli(grpo_args(tmp_path / "resumed", *engine, "resume=auto"))
    for result in (straight, first, resumed):
        assert result.returncode == 0, result.stderr[-3000:]
    keys = ("score", "loss", "grad_norm", "response_len", "mismatch_logp_abs_max")
    rows = [[{k: r[k] for k in keys} for r in read_metrics(tmp_path / name)[0]] for name in ("straight", "resumed")]
    assert len(rows[0]) == STEPS and rows[0] == rows[1]


def test_hf_on_the_one_update_shortcut_measures_the_sampler_against_the_update(tmp_path):
    """ppo.rollout.engine=hf with one update per rollout: no experience forward, so the first ratio is 1 by construction
    and not logged; the mismatch compares the sampler's log-probs (KV-cached decode) with the update's forward."""
    result = run_cli(grpo_args(tmp_path / "run", "ppo.rollout.engine=hf", "ppo.epochs=1", "ppo.mini_batch_size=32",
                               "trainer.eval_every_n_steps=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    train = read_metrics(tmp_path / "run")[0]
    assert all("first_ratio_dev" not in r and "sync_s" not in r for r in train), train
    assert all(0 < r["mismatch_logp_abs_max"] < 1e-4 and abs(r["mismatch_kl"]) < 1e-6 for r in train), train


def _server_pids(weights: Path) -> list[int]:
    """The vLLM servers started on a weights folder under `weights` (each leads a process group of its own)."""
    found = subprocess.run(["pgrep", "-f", f"vllm.entrypoints.openai.api_server --model {weights}"],
                           capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _latest_step(run_dir: Path) -> int:
    """The step of the run's newest complete checkpoint (checkpoints/latest), 0 before the first."""
    latest = run_dir / "checkpoints" / "latest"
    text = latest.read_text().strip() if latest.is_file() else ""
    return int(text.split("_")[1]) if text.startswith("step_") else 0


def test_a_server_llmtrain_starts_is_stopped_and_a_dead_one_stops_the_run(vllm_python, tmp_path):
    out, weights = tmp_path / "run", tmp_path / "weights"
    args = grpo_args(out, f"ppo.rollout.vllm.python={vllm_python}",
                     f"ppo.rollout.vllm.sync_dir={weights}", "ppo.rollout.vllm.start_timeout_s=600",
                     "trainer.max_steps=200", "trainer.save_every_n_steps=1", "trainer.eval_every_n_steps=0")
    log = tmp_path / "stderr.log"  # a file, not a pipe nobody drains while the run goes on
    with open(log, "w") as stderr_file:
        process = subprocess.Popen([PYTHON, "-m", "llmtrain", *args], env=cli_env(), cwd=REPO,
                                   stdout=subprocess.DEVNULL, stderr=stderr_file, text=True)
    try:
        deadline = time.monotonic() + 600
        # any complete step from 2 on (keep_last_k prunes step_2 within a second of steps this short)
        while _latest_step(out) < 2:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        servers = _server_pids(weights)
        assert servers, "no vLLM server runs with the run's weights folder"
        for pid in servers:  # the engine dies mid-run (its own process group: not this test's)
            assert os.getpgid(pid) == pid
            os.killpg(pid, signal.SIGKILL)
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = log.read_text()
    assert process.returncode != 0
    assert "inference engine http://127.0.0.1:" in stderr, stderr[-3000:]
    assert (out / "vllm_server.log").is_file()
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if p.is_dir())
    assert steps and steps[-1] >= 2, steps
    # the run resumes from its last checkpoint with a fresh server, then stops that one too
    resumed = run_cli([*args, "resume=auto", f"trainer.max_steps={steps[-1] + 1}"], timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert not _server_pids(weights), "the server llmtrain started outlived the run"


def test_bad_engines_are_refused_naming_the_url(vllm_server, tmp_path):
    unreachable = run_cli(grpo_args(tmp_path / "a", "ppo.rollout.vllm.urls=[http://127.0.0.1:9]"))
    assert unreachable.returncode != 0 and "inference engine http://127.0.0.1:9" in unreachable.stderr, \
        unreachable.stderr[-3000:]
    other = save_tiny_model(tmp_path / "other_model", heads=2)  # another architecture than the server's
    mismatched = run_cli(grpo_args(tmp_path / "b", f"ppo.rollout.vllm.urls=[{vllm_server.url}]",
                                   f"model.name_or_path={other}", f"model.tokenizer={TOKENIZER_DIR}"))
    assert mismatched.returncode != 0, mismatched.stderr[-3000:]
    assert f"inference engine {vllm_server.url} could not load the policy's weights" in mismatched.stderr, \
        mismatched.stderr[-3000:]
    no_engine = run_cli(["recipe=grpo_tiny", "ppo.rollout.engine=vllm", f"output_dir={tmp_path / 'c'}"])
    assert no_engine.returncode != 0 and "exactly one of ppo.rollout.vllm.urls" in no_engine.stderr
    not_sampling = run_cli(["recipe=sft_tiny", "ppo.rollout.engine=vllm", f"output_dir={tmp_path / 'd'}"])
    assert not_sampling.returncode != 0 and "ppo" in not_sampling.stderr, not_sampling.stderr[-2000:]
