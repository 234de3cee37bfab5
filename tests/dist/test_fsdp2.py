"""FSDP2 (+ tensor parallel, + HSDP) under torchrun (gloo) against DDP, every run loading the same saved
tiny model folder, fp32, global batch 16 = micro × grad accumulation 2 × dp.

- parity: loss AND grad norm of each of 10 steps within 1e-5 relative of DDP (the first within 1e-6);
  the grad norm catches a gradient-scale error (sum instead of average) that Adam hides in the loss.
- accumulation: micro 8 × accumulation 1 equals micro 4 × accumulation 2 (1e-6).
- resume: the parity runs save at step 5; resuming there on the same topology is bitwise (dp=2, tp=2, HSDP
  2 × 2, dp=2 × tp=2), resuming a dp=2 checkpoint at dp=1 and at dp=2 × tp=2 continues within the parity
  tolerance.
- a non-finite loss stops every rank with exit code 3.
- a worker (tests/dist/workers/fsdp2_checks.py under torchrun) checks what the CLI cannot show: a dp=2
  checkpoint loaded at tp=2 holds exactly the saved weights, the consolidated HF export gives the sharded model's
  logits, the per-rank model-state bytes match ZeRO-3's 16·M/N, and optim=muon on DDP, FSDP2 (+ tp) and ZeRO-1/2/3
  equals one-process torch.optim.Muon bit for bit.
- optim=muon: FSDP2 against DDP (loss and grad norm), bitwise resume, and a dp=2 checkpoint resumed at dp=1.
- meta init: only rank 0 builds the model (every run above loads a from_pretrained folder, so their
  parity is that of the meta path); a from_config model with tied embeddings trains as DDP does; a second
  worker checks each rank's weights, buffers, ties and RNG against what DDP builds, and that rank 1's
  host memory grows by its shard, not by the full model, while rank 0 holds the full copy.
Each run is made once per module, all of them in one launch per rank count (`runs`); the resume tests reuse the
parity runs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.dist.workers.fsdp2_checks import TINY
from tests.helpers import (
    PYTHON,
    REPO,
    TOKENIZER_DIR,
    BatchedRuns,
    assert_ok,
    assert_stopped_nonfinite,
    cli_env,
    ranks_refused,
    read_metrics,
    run_cli,
    run_worker,
    save_tiny_model,
)

pytestmark = pytest.mark.dist

# name: (processes, micro batch, overrides); global batch 16 rows for every one
CONTENDERS = {
    "ddp": (2, 4, ["backend=ddp"]),
    "fsdp2": (2, 4, ["backend=fsdp2"]),
    "fsdp2_tp": (2, 8, ["backend=fsdp2_tp"]),  # dp 1 × tp 2
    "dp2_tp2": (4, 4, ["backend=fsdp2_tp"]),  # dp 2 × tp 2
    "hsdp": (4, 2, ["backend=fsdp2", "backend.dp_replicate=2"]),  # 2 replicas × 2 shards
    "dp1": (1, 8, ["backend=fsdp2"]),
    "fsdp2_accum1": (2, 8, ["backend=fsdp2", "trainer.grad_accum_steps=1"]),  # no accumulation: equal to "fsdp2"
    "fsdp2_async": (2, 4, ["backend=fsdp2", "trainer.async_save=true"]),  # saves written in the background (DCP)
    **{f"{name}_muon": (nproc, micro, [backend, "optim=muon"])  # Muon's momentum through DCP, resharded to dp1
       for name, nproc, micro, backend in [("ddp", 2, 4, "backend=ddp"), ("fsdp2", 2, 4, "backend=fsdp2"),
                                           ("dp1", 1, 8, "backend=fsdp2")]},
}
PARITY = [("llama", "fsdp2"), ("llama", "fsdp2_tp"), ("llama", "dp2_tp2"), ("llama", "hsdp"),
          ("qwen2", "fsdp2_tp"), ("qwen2", "dp2_tp2")]  # qwen2: GQA + q/k/v biases, which TP splits


def base_args(model_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["recipe=sft_tiny", f"model.name_or_path={model_dir}", "model.from_config=null", "model.tokenizer=null",
            f"output_dir={out_dir}", "trainer.eval_every_n_steps=0", "data.eval_files=[]",
            "trainer.log_every_n_steps=0", "optim.lr=1e-3", "optim.warmup_steps=2", "trainer.max_steps=10",
            "trainer.grad_accum_steps=2", "trainer.global_batch_size=16", "trainer.save_every_n_steps=5",
            *extra]


def contender_args(name: str, model_dir: Path, out_dir: Path, *extra: str) -> tuple[list[str], int]:
    nproc, micro, overrides = CONTENDERS[name]
    return base_args(model_dir, out_dir, f"trainer.micro_batch_size={micro}", *overrides, *extra), nproc


# resumed run -> (the llama run whose step-5 checkpoint it loads, the contender that resumes it)
RESUMED = {f"{source}_as_{name}": (source, name) for source, name in [
    ("fsdp2", "fsdp2"), ("fsdp2_tp", "fsdp2_tp"), ("hsdp", "hsdp"), ("dp2_tp2", "dp2_tp2"),  # same topology
    ("fsdp2", "dp1"), ("fsdp2", "dp2_tp2"),  # resharded
    ("fsdp2_muon", "fsdp2_muon"), ("fsdp2_muon", "dp1_muon"), ("fsdp2_async", "fsdp2_async")]}
TIED = ["recipe=sft_tiny", "model.from_config.tie_word_embeddings=true", "trainer.eval_every_n_steps=0",
        "data.eval_files=[]", "trainer.log_every_n_steps=0", "optim.lr=1e-3", "trainer.max_steps=3",
        "trainer.grad_accum_steps=1", "trainer.global_batch_size=16", "trainer.save_every_n_steps=0"]
# fsdp2_tp names the fused head (auto keeps full logits at V 263): a tied one is kept whole, not split over the vocab
TIED_RUNS = {"ddp": (8, ["backend=ddp"]), "fsdp2": (8, ["backend=fsdp2"]),
             "fsdp2_tp": (16, ["backend=fsdp2_tp", "model.fused_loss=chunked"])}


def launches(root: Path, models: dict[str, Path]) -> list[tuple[int, list[tuple[str, list[str]]]]]:
    """Every (model, contender) run the tests read (folder MODEL_NAME), the TIED_RUNS (tied_NAME) and the RESUMED
    runs, one launch per rank count: 2 ranks first, then 4 and 1, which resume checkpoints the 2-rank launch saved
    (the 4-rank ones also their own launch's, saved earlier in it)."""
    batches = {2: [], 4: [], 1: []}
    for model, name in [("llama", "ddp"), ("qwen2", "ddp"), *PARITY, ("llama", "fsdp2_accum1"), ("llama", "ddp_muon"),
                        ("llama", "fsdp2_muon"), ("llama", "fsdp2_async")]:
        args, nproc = contender_args(name, models[model], root / f"{model}_{name}")
        batches[nproc].append((f"{model}_{name}", args))
    for tied, (micro, backend) in TIED_RUNS.items():
        batches[2].append((f"tied_{tied}", [*TIED, *backend, f"trainer.micro_batch_size={micro}"]))
    for resumed, (source, name) in RESUMED.items():
        args, nproc = contender_args(name, models["llama"], root / resumed,
                                     f"resume={root}/llama_{source}/checkpoints/step_5")
        batches[nproc].append((resumed, args))
    return list(batches.items())


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> BatchedRuns:
    qwen2 = save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), model_type="qwen2")
    root = tmp_path_factory.mktemp("fsdp2_runs")
    return BatchedRuns(root, launches(root, {"llama": tiny_model_dir, "qwen2": qwen2}))


@pytest.mark.parametrize("model,name", PARITY)
def test_parity_with_ddp(runs, model, name, assert_close_series):
    reference, ours = read_metrics(runs(f"{model}_ddp"))[0], read_metrics(runs(f"{model}_{name}"))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]  # the same examples
    assert_close_series(ours, reference, "loss", 1e-6, 1e-5)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]


def resume(runs: BatchedRuns, source: str, name: str) -> tuple[list[dict], list[dict]]:
    """(the source run's steps 6-10, the same steps trained by `name` resumed from its step-5 checkpoint)."""
    straight = runs(f"llama_{source}")
    continued = read_metrics(runs(f"{source}_as_{name}"))[0]
    assert [r["step"] for r in continued] == list(range(6, 11))
    return read_metrics(straight)[0][5:], continued


def test_live_activations_and_communication_match_the_plan(runs, assert_live_cost_matches_the_plan):
    """FSDP2's all-gathers (forward and backward) and reduce-scatter counted on step 2 within 5 % of the plan;
    activations within 25 %."""
    assert_live_cost_matches_the_plan(runs("llama_fsdp2"), states=False)  # accumulation 2: see the helper


def test_accumulation_does_not_change_the_step(runs, assert_close_series):
    """Micro 8 × accumulation 1 equals micro 4 × accumulation 2 on 2 FSDP2 ranks: loss and grad norm of every step
    to 1e-6 relative."""
    reference, ours = read_metrics(runs("llama_fsdp2"))[0], read_metrics(runs("llama_fsdp2_accum1"))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    assert [r["lr"] for r in ours] == [r["lr"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-6)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-6)


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_tp", "hsdp", "dp2_tp2", "fsdp2_async"])
def test_bitwise_resume_same_topology(runs, name):
    """fsdp2_async (trainer.async_save): its step-5 checkpoint was written by DCP's thread while steps 6.. trained;
    that run, and the run resumed from it (saving in the background too), equal the synchronous run bit for bit."""
    reference, continued = resume(runs, name, name)
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in continued] == [r[key] for r in reference]
    if name == "fsdp2_async":
        synchronous, background = (read_metrics(runs(f"llama_{run}"))[0] for run in ("fsdp2", "fsdp2_async"))
        assert [(r["loss"], r["grad_norm"]) for r in background] == [(r["loss"], r["grad_norm"]) for r in synchronous]
        assert sorted(p.name for p in (runs("fsdp2_async_as_fsdp2_async") / "checkpoints").iterdir()) == \
            ["latest", "step_10"]  # the resumed run's own save, finalised at the end of fit


@pytest.mark.parametrize("name", ["dp1", "dp2_tp2"])
def test_dp2_checkpoint_resumes_resharded(runs, name, assert_close_series):
    """Model, Adam state and schedule saved at dp=2 continue at dp=1 (one process) and at dp=2 × tp=2."""
    reference, continued = resume(runs, "fsdp2", name)
    assert [r["lr"] for r in continued] == [r["lr"] for r in reference]
    assert_close_series(continued, reference, "loss", 1e-6, 1e-5)
    assert_close_series(continued, reference, "grad_norm", 1e-6, 1e-5)


def test_muon_parity_bitwise_resume_and_reshard(runs, assert_close_series):
    """optim=muon: FSDP2 (dp=2) against DDP, loss of each step within 1e-5 relative, grad norm within 1e-4 (torch's
    Newton-Schulz runs in bf16 and turns last-bit gradient differences into ~1e-5 weight differences; measured
    1.1e-6 and 1.8e-5; the bitwise comparison with torch is the worker's, on equal gradients); resumed at step 5
    on the same mesh bitwise, at dp=1 within 1e-5."""
    reference, ours = read_metrics(runs("llama_ddp_muon"))[0], read_metrics(runs("llama_fsdp2_muon"))[0]
    assert [r["lr"] for r in ours] == [r["lr"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-5)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-4)
    assert reference[-1]["loss"] < reference[0]["loss"]
    straight, continued = resume(runs, "fsdp2_muon", "fsdp2_muon")
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in continued] == [r[key] for r in straight]
    straight, continued = resume(runs, "fsdp2_muon", "dp1_muon")
    assert [r["lr"] for r in continued] == [r["lr"] for r in straight]
    assert_close_series(continued, straight, "loss", 1e-6, 1e-5)


def test_resharded_load_export_and_bytes(runs, tiny_model_dir, tmp_path):
    """Worker under torchrun, 2 ranks (`worker` in tests/dist/workers/fsdp2_checks.py)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step_dir = runs("llama_fsdp2") / "checkpoints" / "step_5"
    reports = run_worker("tests.dist.workers.fsdp2_checks", tmp_path, str(tiny_model_dir), str(step_dir), timeout=600)
    # the planner's FSDP2 figure (fp32: shards 4M + grads 4M + Adam m, v 8M, split over N = 2 ranks; no
    # accumulation, so gradients are sharded too); the gathered blocks are released by then
    from llmtrain.backends import BACKENDS
    from llmtrain.metrics.cost import Layout, RoleParams, state_bytes

    for report in reports:
        planned = state_bytes(RoleParams(trainable=report["parameters"]),
                              Layout(name="fsdp2", backend=BACKENDS["fsdp2"], stage=3, dp=2), "fp32", 1, on_gpu=False)
        expected = planned.held - planned.gathered
        assert abs(report["model_state_bytes"] - expected) <= 0.05 * expected, report
    assert sum(r["model_state_bytes"] for r in reports) == 16 * reports[0]["parameters"]  # nothing duplicated
    assert reports[0]["export_logits_max_abs_diff"] <= 1e-6
    # optim=muon on DDP, FSDP2, FSDP2 + tp, ZeRO-1/2/3: the weights after 3 steps are one-process
    # torch.optim.Muon + AdamW's bit for bit (tests/dist/workers/muon_checks.py)
    assert reports[0]["muon_max_abs_diff"] == {name: 0.0 for name in ("ddp", "fsdp2", "fsdp2_tp", "zero1", "zero2",
                                                                        "zero3")}
    # the tp=2 engine loaded exactly the weights the dp=2 run saved (its export is those weights)
    dcp_to_torch_save(step_dir / "engines" / "policy" / "dcp", tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)["model"]
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == saved.keys()
    for key, tensor in saved.items():
        assert torch.equal(exported[key], tensor), key


def test_nonfinite_loss_stops_every_rank(tiny_model_dir, tmp_path):
    """fp32, lr 1e30: step 1's update makes the weights overflow, step 2's loss is NaN; every rank says so and
    exits with code 3 (torchrun reports the first rank to exit and stops the other), nothing is saved."""
    args, nproc = contender_args("fsdp2", tiny_model_dir, tmp_path / "run", "optim.lr=1e30", "optim.warmup_steps=0",
                                 "optim.max_grad_norm=0", "trainer.max_steps=4")
    assert_stopped_nonfinite(run_cli(args, nproc=nproc), nproc=nproc, step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "run")[0]] == [1]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("model_type,nproc,overrides,needles", [
    ("gpt2", 2, ["backend=fsdp2_tp"], ["backend.tp=2", "'gpt2'", "no tensor-parallel plan", "backend=ddp"]),
    ("llama", 3, ["backend=fsdp2", "backend.tp=3"],
     ["backend.tp=3", "num_attention_heads=4", "num_key_value_heads=2", "backend.dp_shard=1"]),
    ("llama", 2, ["backend=fsdp2", "backend.tp=2", "backend.dp_shard=2"],
     ["backend.dp_replicate=1 × backend.dp_shard=2 × backend.tp=2 = 4", "not the world size 2"]),
])
def test_bad_layout_fails_on_every_rank_before_the_model_loads(tiny_model_dir, tmp_path, model_type, nproc,
                                                               overrides, needles):
    model_dir = tiny_model_dir if model_type == "llama" else save_tiny_model(tmp_path / model_type, model_type)
    result = run_cli(base_args(model_dir, tmp_path / "run", "trainer.global_batch_size=null", *overrides),
                     nproc=nproc)
    reported = ranks_refused(result, nproc)
    for needle in needles:
        assert result.stderr.count(needle) >= len(reported), (needle, result.stderr[-3000:])
    assert not (tmp_path / "run").exists()


# ---- meta init: rank 0 builds the model, the others receive their shards ------------------------------------

@pytest.mark.parametrize("model,name,meta_ranks", [("llama", "fsdp2", "rank 1"), ("llama", "dp2_tp2", "ranks 1, 2, 3"),
                                                   ("llama", "hsdp", "ranks 1, 2, 3")])
def test_only_rank0_builds_the_model(runs, model, name, meta_ranks):
    """The parity runs above (from_pretrained folders) built the model on meta on every rank but 0."""
    assert f"fsdp2: {meta_ranks} built the model on meta, weights from rank 0" in runs.log(f"{model}_{name}")


def test_from_config_with_tied_embeddings_trains_as_ddp(runs, assert_close_series):
    """Random init (not a folder) on rank 0 only, and embedding / LM head tied (under tp the head stays replicated,
    said in the log): 3 steps as DDP's (TIED_RUNS)."""
    metrics = {}
    for name in TIED_RUNS:
        log = runs.log(f"tied_{name}")
        assert (name == "ddp") != ("rank 1 built the model on meta" in log)
        assert (name == "fsdp2_tp") == ("LM head is tied to the input embedding: kept replicated over tp" in
                                        log)  # models/vocab_parallel.py splits untied heads only
        metrics[name] = read_metrics(runs(f"tied_{name}"))[0]
    for name in ("fsdp2", "fsdp2_tp"):
        assert_close_series(metrics[name], metrics["ddp"], "loss", 1e-6, 1e-5)
        assert_close_series(metrics[name], metrics["ddp"], "grad_norm", 1e-6, 1e-5)


def test_meta_init_weights_buffers_ties_and_memory(tmp_path):
    """Worker under torchrun, 2 ranks (`init_worker` in tests/dist/workers/fsdp2_checks.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # a from_pretrained folder whose vocabulary is smaller than the tokenizer's: both paths resize
    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER_DIR)) - 7
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=vocab, **TINY)).save_pretrained(
        tmp_path / "small_vocab")
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m",
           "tests.dist.workers.fsdp2_checks", "init", str(tmp_path / "small_vocab"), str(tmp_path)]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert_ok(result)
    reports = [json.loads((tmp_path / f"init_rank_{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        for case in ("tied_dp2", "tied_tp2", "resized_folder_dp2"):
            checks = report[case]
            assert checks["built_on_meta"] == (rank == 1), (rank, case)
            assert checks["ties"] == checks["reference_ties"], (rank, case, checks)
            assert checks["buffers_equal"] and checks["rng_as_ddp"], (rank, case, checks)
            if rank == 0:
                assert checks["weights_equal"], (case, checks)  # every full tensor, bitwise, as DDP's init
        assert report["tied_dp2"]["ties"] == [True]
    full_bytes = 4 * reports[0]["memory"]["parameters"]  # fp32, ~200 MB
    rank0, rank1 = (r["memory"]["init_rss_growth"] for r in reports)
    assert rank0 >= 0.95 * full_bytes, (rank0, full_bytes)  # the full copy, then its shard as well
    assert rank1 <= 0.75 * full_bytes, (rank1, full_bytes)  # its half (0.5) and one tensor in flight
