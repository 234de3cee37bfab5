"""The command line end to end: dry runs, run-dir safety, resume, torn checkpoints, W&B offline
files, secrets, HF export, non-finite steps, bad input on every rank, the installed layout."""

from __future__ import annotations

import glob
import hashlib
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import wandb_log
from tests.helpers import REPO, assert_ok, assert_stopped_nonfinite, cli_env, ranks_refused, read_metrics, run_cli

pytestmark = pytest.mark.e2e

FAKE_SECRETS = {"WANDB_API_KEY": "wandb-fake-secret-7f3a9c", "HF_TOKEN": "hf_fake_secret_Q81zz",
                "OPENAI_API_KEY": "sk-fake-secret-000111"}
TINY = ["recipe=sft_tiny", "trainer.log_every_n_steps=0", "trainer.eval_every_n_steps=2"]
PEAK_TFLOPS = 0.01  # a stated peak: the run logs MFU against it (a CPU has none of its own)


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory) -> Path:
    """4 steps, checkpoints at 2 and 4, W&B offline, fake secrets planted in the environment."""
    run_dir = tmp_path_factory.mktemp("wandb_run") / "run"
    result = run_cli([*TINY, "trainer.max_steps=4", "trainer.save_every_n_steps=2", "logger=wandb",
                      f"output_dir={run_dir}", f"plan.peak_tflops={PEAK_TFLOPS}"], env=cli_env(**FAKE_SECRETS))
    assert_ok(result)
    return run_dir


def test_metrics_file_has_every_step(wandb_run):
    train, evals = read_metrics(wandb_run)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in train:
        assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s"} <= set(r)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"])
    assert all(abs(e["eval_ppl"] - 2.718281828 ** e["eval_loss"]) < 1e-6 * e["eval_ppl"] for e in evals)


def test_secrets_never_reach_the_run_dir(wandb_run):
    for path in wandb_run.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for name, secret in FAKE_SECRETS.items():
                assert secret.encode() not in data, f"{name} leaked into {path}"


def wandb_logs(run_dir: Path) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))


def test_wandb_offline_run_holds_grouped_metrics_and_config(wandb_run):
    """Read back with W&B's own records: train/, eval/, perf/ names, eval plotted against the train step, the
    resolved config with its run metadata, and the run id kept in the run dir."""
    (log,) = wandb_logs(wandb_run)
    rows = {row["_step"]: row for row in wandb_log.history(log)}
    train, evals = read_metrics(wandb_run)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for record in train:
        row = rows[record["step"]]
        assert row["train/loss"] == record["loss"] and row["train/grad_norm"] == record["grad_norm"]
        assert row["train/lr"] == record["lr"] and row["perf/tokens_per_s"] == record["tokens_per_s"]
        assert row["train/step"] == record["step"] and "loss" not in row
    for record in evals:
        assert rows[record["step"]]["eval/loss"] == record["eval_loss"]
        assert rows[record["step"]]["eval/accuracy"] == record["eval_accuracy"]
    assert wandb_log.metric_definitions(log)["eval/*"] == "train/step"
    config = wandb_log.config(log)
    assert config["trainer"]["micro_batch_size"] == 32 and config["recipe"] == "sft_tiny"
    assert config["run_metadata"]["backend"] == "ddp" and config["run_metadata"]["world_size"] == 1
    assert json.loads((wandb_run / "wandb.json").read_text()) == {"id": wandb_log.run_id(log), "last_step": 4}


def test_live_cost_on_the_first_steps_next_to_the_plan(wandb_run):
    """Steps 1-2 carry the measured activations (saved-tensor hooks), the peak RSS and the planner's figures; the
    plan's gated-block count (metrics/cost.py) is within 25 % of the measured bytes (measured: +0.2 %); the model
    states match the plan; later steps carry none of it. W&B shows them under memory/."""
    train = read_metrics(wandb_run)[0]
    first = train[0]  # model states are logged once, when the optimizer state exists
    states = first["memory_r0_params"] + first["memory_r0_grads"] + first["memory_r0_optimizer"]
    assert abs(states - first["plan_memory_state"]) <= 0.05 * first["plan_memory_state"]
    for record in train[:2]:
        measured, planned = record["memory_r0_activations"], record["plan_memory_activations"]
        assert abs(measured - planned) <= 0.25 * planned, f"activations {measured} vs plan {planned}"
        assert record["memory_r0_rss_peak"] > states + measured  # the process holds at least those tensors
        assert record["memory_r0_activation_rows"] == 32 and 0 < record["memory_r0_activation_seq"] <= 64
        assert record["memory_r0_plan_activations"] == planned
    assert not any(k.startswith(("memory_r0_activations", "plan_memory")) for r in train[2:] for k in r)
    # MFU: this rank's tokens (rows × padded length: one forward a step here) × (6·M + 12·L·h·s) over time × peak
    flops_per_token = 6 * 461_184 + 12 * 2 * 128 * 64  # sft_tiny: M, L, h, s = max_seq_len
    for record in train[:2]:
        tokens = record["memory_r0_activation_rows"] * record["memory_r0_activation_seq"]
        assert record["mfu"] == pytest.approx(tokens * flops_per_token / (record["step_time_s"] * PEAK_TFLOPS * 1e12))
        assert record["hfu"] == record["mfu"]  # no activation checkpointing: no recompute
    rows = {row["_step"]: row for row in wandb_log.history(wandb_logs(wandb_run)[0])}
    assert rows[1]["memory/r0_activations"] == train[0]["memory_r0_activations"]
    assert rows[1]["memory/plan_activations"] == train[0]["plan_memory_activations"]


def test_config_yaml_has_run_metadata(wandb_run):
    import yaml

    saved = yaml.safe_load((wandb_run / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 4
    meta = saved["run_metadata"]
    assert meta["world_size"] == 1 and meta["backend"] == "ddp" and meta["versions"]["torch"] == torch.__version__
    assert meta["precision"] == "fp32" and meta["device"] == "cpu"  # precision=auto on a CPU


def test_hf_export_reloads_with_identical_logits(wandb_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(wandb_run / "hf").eval()
    trained = AutoModelForCausalLM.from_pretrained(wandb_run / "hf").eval()
    state = torch.load(wandb_run / "checkpoints" / "step_4" / "engines" / "policy" / "model.pt", weights_only=True)
    trained.load_state_dict(state)  # the trained engine's weights, as checkpointed at the last step
    tokenizer = AutoTokenizer.from_pretrained(wandb_run / "hf")
    ids = torch.tensor([tokenizer("reverse: hello\n").input_ids])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    initial = AutoModelForCausalLM.from_config(exported.config)
    assert not torch.equal(initial.lm_head.weight, exported.lm_head.weight)


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory) -> Path:
    """2 steps of precision=fp16 (autocast + dynamic loss scaling), checkpointed at step 2."""
    run_dir = tmp_path_factory.mktemp("fp16") / "run"
    assert_ok(run_cli([*TINY, "trainer.max_steps=2", "trainer.eval_every_n_steps=0", "precision=fp16",
                       f"output_dir={run_dir}"]))
    return run_dir


def test_fp16_with_loss_scaler_tracks_fp32(wandb_run, fp16_run):
    """precision=fp16 tracks fp32 to 1 %; the scaler's state is checkpointed."""
    fp16, fp32 = read_metrics(fp16_run)[0], read_metrics(wandb_run)[0][:2]
    for a, b in zip(fp16, fp32):
        assert a["loss"] != b["loss"] and abs(a["loss"] - b["loss"]) < 1e-2 * b["loss"]
    scaler = torch.load(fp16_run / "checkpoints" / "step_2" / "engines" / "policy" / "scaler.pt", weights_only=True)
    assert scaler["scale"] == 2.0 ** 16  # torch's initial scale: no overflow, and 2 steps are no growth interval


def test_fp16_overflow_is_skipped_by_the_scaler_and_its_scale_resumes(fp16_run, tmp_path):
    """The step-2 fp16 checkpoint with its loss scale raised to 2**40: the resumed run must start from that scale
    (a fresh scaler's 2**16 would not overflow), so the scaled gradients overflow in fp16, the scaler skips the
    update (the weights and Adam's state stay those of step 2) and halves its scale, and training continues."""
    step_2 = tmp_path / "poisoned" / "checkpoints" / "step_2"
    shutil.copytree(fp16_run / "checkpoints" / "step_2", step_2)
    saved = step_2 / "engines" / "policy"
    scaler = torch.load(saved / "scaler.pt", weights_only=True)
    torch.save({**scaler, "scale": 2.0 ** 40}, saved / "scaler.pt")
    run_dir = tmp_path / "resumed"
    assert_ok(run_cli([*TINY, "trainer.eval_every_n_steps=0", "precision=fp16", "trainer.max_steps=3",
                       f"output_dir={run_dir}", f"resume={step_2}"]))
    (step_3,) = read_metrics(run_dir)[0]
    assert step_3["step"] == 3 and math.isfinite(step_3["loss"]) and not math.isfinite(step_3["grad_norm"])
    assert step_3["skipped_steps"] == 0  # the scaler's own skip, not trainer.skip_nonfinite's
    after = run_dir / "checkpoints" / "step_3" / "engines" / "policy"
    assert torch.load(after / "scaler.pt", weights_only=True)["scale"] == 2.0 ** 39
    weights_before, weights_after = (torch.load(d / "model.pt", weights_only=True) for d in (saved, after))
    assert all(torch.equal(weights_after[name], tensor) for name, tensor in weights_before.items())
    adam_before, adam_after = (torch.load(d / "optimizer.pt", weights_only=True)["state"] for d in (saved, after))
    assert all(torch.equal(adam_after[i]["exp_avg"], state["exp_avg"]) and adam_after[i]["step"] == state["step"]
               for i, state in adam_before.items())


def tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def test_existing_run_dir_is_not_overwritten_and_resume_auto_continues(wandb_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(wandb_run, run_dir)
    before = tree_digest(run_dir / "checkpoints")
    refused = run_cli([*TINY, "trainer.max_steps=6", f"output_dir={run_dir}"])
    assert refused.returncode == 2 and "resume=auto" in refused.stderr
    assert tree_digest(run_dir / "checkpoints") == before
    assert_ok(run_cli([*TINY, "trainer.max_steps=6", f"output_dir={run_dir}", "resume=auto"]))
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_6"


CONFIG_SECRETS = {"hub_token": "cfg-fake-hub-token-5d1e", "note": "hf_cfgFakeSecretValue99"}  # a key, a value


def test_torn_checkpoint_is_ignored_and_wandb_continues_its_run(wandb_run, tmp_path):
    """Resume from step_2 (step_4 torn): steps 3-4 are redone with identical losses; W&B continues the same run
    and is sent only step 5 (3 and 4 it had); secrets planted in the environment and the config reach no W&B file."""
    run_dir = tmp_path / "run"
    shutil.copytree(wandb_run, run_dir)
    (run_dir / "checkpoints" / "step_4" / "COMPLETE").unlink()  # as if the save died before its marker
    # a backend=ddp config has no free-form mapping (backend.ds_config_overrides is the deepspeed group's and is
    # refused on ddp): the value-shaped secret goes into the run's W&B tags, the key-shaped one stays in the env
    planted = f"logger.wandb.tags=[{CONFIG_SECRETS['note']}]"
    result = run_cli([*TINY, "trainer.max_steps=5", f"output_dir={run_dir}", "resume=auto", "logger=wandb", planted],
                     env=cli_env(**FAKE_SECRETS))
    assert_ok(result)
    assert "not complete" in result.stderr or "no COMPLETE marker" in result.stderr
    train = read_metrics(run_dir)[0]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]  # steps 3-4 redone from step_2
    original = read_metrics(wandb_run)[0]
    assert [r["loss"] for r in train[:4]] == [r["loss"] for r in original]
    first, resumed = wandb_logs(run_dir)
    assert wandb_log.run_id(first) == wandb_log.run_id(resumed)
    assert [row["_step"] for row in wandb_log.history(resumed)] == [5]
    assert wandb_log.history(resumed)[0]["train/loss"] == train[4]["loss"]
    assert wandb_log.config(resumed)["logger"]["wandb"]["tags"] == ["<redacted>"]
    for path in (run_dir / "wandb").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for secret in [*FAKE_SECRETS.values(), *CONFIG_SECRETS.values()]:
                assert secret.encode() not in data, f"{secret} leaked into {path}"


def test_dry_run_of_a_7b_recipe_loads_nothing(tmp_path):
    start = time.time()
    result = run_cli(["recipe=sft_7b", "dry_run=true"], cwd=tmp_path)  # any working directory
    assert_ok(result)
    # Llama-2-7B by hand: L(4h² + 3hi + 2h) + 2Vh + h, h=4096, i=11008, L=32, V=32000
    h, i, layers, vocab = 4096, 11008, 32, 32000
    expected = layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * vocab * h + h
    assert f"{expected / 1e6:,.1f}M parameters" in result.stdout
    assert "global batch 16 rows = micro_batch_size 4 × grad_accum_steps 4 × dp 1" in result.stdout
    assert time.time() - start < 60 and not (tmp_path / "runs").exists()
    result = run_cli(["recipe=pretrain_7b", "dry_run=true"], cwd=tmp_path)
    assert_ok(result)
    for line in ("recipe pretrain_7b: stage pretrain, backend deepspeed, precision fp32 on cpu, world 1",
                 f"model meta-llama/Llama-2-7b-hf: {expected / 1e6:,.1f}M parameters "
                 "(L=32, h=4096, heads=32, vocab=32000)",
                 "global batch 32 rows = micro_batch_size 2 × grad_accum_steps 16 × dp 1 "
                 "(≤ 131072 tokens at max_seq_len 4096)",
                 "5000 steps, output_dir runs/pretrain_7b"):
        assert line in result.stdout.splitlines(), (line, result.stdout)
    assert not (tmp_path / "runs").exists()


def test_bad_config_fails_on_every_rank_within_seconds(tmp_path):
    start = time.time()
    result = run_cli([*TINY, "trainer.global_batch_size=7", f"output_dir={tmp_path / 'x'}"], nproc=2)
    ranks_refused(result, 2)
    assert "trainer.global_batch_size=7" in result.stderr and time.time() - start < 60


def test_missing_data_column_names_the_field(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n")
    result = run_cli([*TINY, f"data.train_files=[{data}]", "data.eval_files=[]", f"output_dir={tmp_path / 'x'}"])
    assert result.returncode == 2 and "data.format" in result.stderr and "prompt" in result.stderr
    assert not (tmp_path / "x").exists()


def test_non_finite_loss_stops_all_ranks_or_is_skipped(tmp_path):
    blow_up = [*TINY, "trainer.eval_every_n_steps=0", "optim.lr=1e30", "optim.warmup_steps=0",
               "optim.max_grad_norm=0", "trainer.max_steps=4"]
    stopped = run_cli([*blow_up, f"output_dir={tmp_path / 'a'}"], nproc=2)
    assert_stopped_nonfinite(stopped, nproc=2, step=2)
    skipped = run_cli([*blow_up, "trainer.skip_nonfinite=true", f"output_dir={tmp_path / 'b'}"])
    assert_ok(skipped)
    train = read_metrics(tmp_path / "b")[0]
    assert train[-1]["skipped_steps"] >= 1 and train[-1]["skipped_steps"] == sum(
        1 for r in train if not (abs(r["loss"]) < float("inf") and abs(r["grad_norm"]) < float("inf")))


def test_installed_package_runs_from_anywhere(tmp_path):
    """A non-editable install (the wheel) carries conf/, recipes/ and assets/."""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheel_dir), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next(wheel_dir.glob("llmtrain-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = cli_env(PYTHONPATH=str(target))
    imported = subprocess.run([sys.executable, "-c", "import llmtrain; print(llmtrain.__file__)"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert imported.stdout.strip() == str(target / "llmtrain" / "__init__.py")  # the wheel's copy, not the repo
    result = subprocess.run([sys.executable, "-m", "llmtrain", "recipe=sft_tiny", "dry_run=true"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert_ok(result)
    # the plan of the shipped recipe: 2-layer Llama, h=128, GQA 4/2 heads, MLP 384, vocab 263, untied, by hand
    h, kv, mlp, vocab = 128, 64, 384, 263
    params = 2 * (2 * h * h + 2 * h * kv + 3 * h * mlp + 2 * h) + 2 * vocab * h + h
    lines = result.stdout.splitlines()
    assert lines[:8] == [
        "recipe sft_tiny: stage sft, backend ddp, precision fp32 on cpu, world 1",
        f"model llama: {params / 1e6:,.1f}M parameters (L=2, h=128, heads=4, vocab=263)",
        "training FLOPs ≈ 6·M + 12·L·h·s = 3.0 MFLOP per token at s=64",
        f"model states (fp32 Adam, ddp, sharding as ZeRO stage 0, dp 1) ≈ {16 * params / 2 ** 20:.1f} MiB per rank per "
        "trainable role (activations not included)",
        "roles: policy (trainable)",
        "global batch 32 rows = micro_batch_size 32 × grad_accum_steps 1 × dp 1 (≤ 2048 tokens at max_seq_len 64)",
        "500 steps, output_dir runs/sft_tiny", ""]
    assert lines[8].startswith("plan: 1 × cpu")  # then the planner's
    assert any(line.startswith("ddp: fits at micro-batch 32 ") for line in lines)
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    assert (target / "llmtrain" / "_recipes" / "sft_7b.yaml").is_file()
    assert (target / "llmtrain" / "assets" / "tokenizer" / "tokenizer.json").is_file()


def test_launch_torchrun_script_starts_two_ranks(tmp_path):
    import os

    import yaml

    env = cli_env(NPROC="2", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = subprocess.run(["bash", str(REPO / "launch" / "torchrun.sh"), *TINY, "trainer.max_steps=2",
                             f"output_dir={tmp_path}"], env=env, capture_output=True, text=True, timeout=300)
    assert_ok(result)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["run_metadata"]["world_size"] == 2
    assert [r["step"] for r in read_metrics(tmp_path)[0]] == [1, 2]


def test_checkpoint_of_the_single_engine_layout_still_resumes(wandb_run, tmp_path):
    """A step folder as written before roles existed (engine/, trainer_state.json) resumes as the role policy."""
    run_dir = tmp_path / "run"
    shutil.copytree(wandb_run, run_dir)
    step_2 = run_dir / "checkpoints" / "step_2"
    (step_2 / "engines" / "policy").rename(step_2 / "engine")
    (step_2 / "engines").rmdir()
    state = json.loads((step_2 / "trainer.json").read_text())
    (step_2 / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "parent"}))
    (step_2 / "trainer.json").unlink()
    (step_2 / "stage.json").unlink()
    assert_ok(run_cli([*TINY, "trainer.max_steps=4", f"output_dir={tmp_path / 'continued'}", f"resume={step_2}"]))
    continued, original = read_metrics(tmp_path / "continued")[0], read_metrics(wandb_run)[0]
    assert [r["loss"] for r in continued] == [r["loss"] for r in original[2:]]


def test_resume_from_an_older_step_prunes_the_abandoned_continuation(tmp_path):
    """6 steps saved at 2, 4, 6; resumed from step 2 into the same run dir up to step 4: the new step_4 replaces
    the old one, step_6 (the abandoned continuation) goes, and `latest` and resume=auto follow the new run."""
    run_dir = tmp_path / "run"
    common = [*TINY, "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=2", "trainer.keep_last_k=3",
              f"output_dir={run_dir}"]
    assert_ok(run_cli([*common, "trainer.max_steps=6"]))
    original = read_metrics(run_dir)[0]
    assert_ok(run_cli([*common, "trainer.max_steps=4", f"resume={run_dir}/checkpoints/step_2"]))
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2", "step_4"]
    assert json.loads((checkpoints / "step_4" / "trainer.json").read_text())["parent"] == "step_2"
    assert (checkpoints / "latest").read_text().strip() == "step_4"
    assert [r["loss"] for r in read_metrics(run_dir)[0]] == [r["loss"] for r in original[:4]]
    assert_ok(run_cli([*common, "trainer.max_steps=5", "resume=auto"]))
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2, 3, 4, 5]
