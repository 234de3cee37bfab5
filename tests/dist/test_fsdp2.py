"""FSDP2 (+ tensor parallel, + HSDP) under torchrun (gloo) against DDP, every run loading the same saved
tiny model folder, fp32, global batch 16 = micro × grad accumulation 2 × dp.

- parity: loss AND grad norm of each of 10 steps within 1e-5 relative of DDP (the first within 1e-6);
  the grad norm catches a gradient-scale error (sum instead of average) that Adam hides in the loss.
- accumulation: micro 8 × accumulation 1 equals micro 4 × accumulation 2 (1e-6).
- resume: the parity runs save at step 5; resuming there on the same topology is bitwise (dp=2, tp=2, HSDP
  2 × 2, dp=2 × tp=2), resuming a dp=2 checkpoint at dp=1 and at dp=2 × tp=2 continues within the parity
  tolerance.
- a non-finite loss stops every rank with exit code 3.
- a worker (this file under torchrun) checks what the CLI cannot show: a dp=2 checkpoint loaded at
  tp=2 holds exactly the saved weights, the consolidated HF export gives the sharded model's logits,
  and the per-rank model-state bytes match ZeRO-3's 16·M/N.
- meta init: only rank 0 builds the model (every run above loads a from_pretrained folder, so their
  parity is that of the meta path); a from_config model with tied embeddings trains as DDP does; a second
  worker checks each rank's weights, buffers, ties and RNG against what DDP builds, and that rank 1's
  host memory grows by its shard, not by the full model, while rank 0 holds the full copy.
Runs are cached per module, so the resume tests reuse the parity runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (PYTHON, REPO, TOKENIZER_DIR, assert_ok, assert_stopped_nonfinite, cli_env, read_metrics,
                            run_cli, save_tiny_model)
from tests.dist.live_cost import assert_live_cost_matches_the_plan
from tests.dist.test_ddp import assert_close_series

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


class Runs:
    """Each (model, contender) trained once per module; later tests reuse the run folder."""

    def __init__(self, root: Path, models: dict[str, Path]):
        self.root, self.models, self.done, self.logs = root, models, {}, {}

    def get(self, model: str, name: str) -> Path:
        if (model, name) not in self.done:
            out = self.root / f"{model}_{name}"
            args, nproc = contender_args(name, self.models[model], out)
            result = run_cli(args, nproc=nproc)
            assert_ok(result)
            self.done[(model, name)], self.logs[(model, name)] = out, result.stdout + result.stderr
        return self.done[(model, name)]

    def log(self, model: str, name: str) -> str:
        self.get(model, name)
        return self.logs[(model, name)]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> Runs:
    qwen2 = save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), model_type="qwen2")
    return Runs(tmp_path_factory.mktemp("fsdp2_runs"), {"llama": tiny_model_dir, "qwen2": qwen2})


@pytest.mark.parametrize("model,name", PARITY)
def test_parity_with_ddp(runs, model, name):
    reference, ours = read_metrics(runs.get(model, "ddp"))[0], read_metrics(runs.get(model, name))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]  # the same examples
    assert_close_series(ours, reference, "loss", 1e-6, 1e-5)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]


def resume(runs: Runs, source: str, name: str, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """(the source run's steps 6-10, the same steps trained by `name` resumed from its step-5 checkpoint)."""
    straight = runs.get("llama", source)
    args, nproc = contender_args(name, runs.models["llama"], tmp_path / "resumed",
                                 f"resume={straight}/checkpoints/step_5")
    assert_ok(run_cli(args, nproc=nproc))
    continued = read_metrics(tmp_path / "resumed")[0]
    assert [r["step"] for r in continued] == list(range(6, 11))
    return read_metrics(straight)[0][5:], continued


def test_live_activations_and_communication_match_the_plan(runs):
    """FSDP2's all-gathers (forward and backward) and reduce-scatter counted on step 2 within 5 % of the plan;
    activations within 25 %."""
    assert_live_cost_matches_the_plan(runs.get("llama", "fsdp2"), states=False)  # accumulation 2: see the helper


def test_accumulation_does_not_change_the_step(runs):
    """Micro 8 × accumulation 1 equals micro 4 × accumulation 2 on 2 FSDP2 ranks: loss and grad norm of every step
    to 1e-6 relative."""
    reference, ours = read_metrics(runs.get("llama", "fsdp2"))[0], read_metrics(runs.get("llama", "fsdp2_accum1"))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    assert [r["lr"] for r in ours] == [r["lr"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-6)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-6)


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_tp", "hsdp", "dp2_tp2"])
def test_bitwise_resume_same_topology(runs, tmp_path, name):
    reference, continued = resume(runs, name, name, tmp_path)
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in continued] == [r[key] for r in reference]


@pytest.mark.parametrize("name", ["dp1", "dp2_tp2"])
def test_dp2_checkpoint_resumes_resharded(runs, tmp_path, name):
    """Model, Adam state and schedule saved at dp=2 continue at dp=1 (one process) and at dp=2 × tp=2."""
    reference, continued = resume(runs, "fsdp2", name, tmp_path)
    assert [r["lr"] for r in continued] == [r["lr"] for r in reference]
    assert_close_series(continued, reference, "loss", 1e-6, 1e-5)
    assert_close_series(continued, reference, "grad_norm", 1e-6, 1e-5)


def test_resharded_load_export_and_bytes(runs, tmp_path):
    """Worker under torchrun, 2 ranks (see `worker` below)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step_dir = runs.get("llama", "fsdp2") / "checkpoints" / "step_5"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m",
           "tests.dist.test_fsdp2", str(runs.models["llama"]), str(step_dir), str(tmp_path)]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert_ok(result)
    reports = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    # the planner's FSDP2 figure (fp32: shards 4M + grads 4M + Adam m, v 8M, split over N = 2 ranks; no
    # accumulation, so gradients are sharded too); the gathered blocks are released by then
    from llmtrain.metrics.cost import Layout, RoleParams, state_bytes

    for report in reports:
        planned = state_bytes(RoleParams(trainable=report["parameters"]),
                              Layout(name="fsdp2", library="fsdp2", stage=3, dp=2), "fp32", 1, on_gpu=False)
        expected = planned.held - planned.gathered
        assert abs(report["model_state_bytes"] - expected) <= 0.05 * expected, report
    assert sum(r["model_state_bytes"] for r in reports) == 16 * reports[0]["parameters"]  # nothing duplicated
    assert reports[0]["export_logits_max_abs_diff"] <= 1e-6
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
    ("llama", 3, ["backend=fsdp2", "backend.tp=3"], ["backend.tp=3", "num_attention_heads=4", "num_key_value_heads=2", "backend.dp_shard=1"]),
    ("llama", 2, ["backend=fsdp2", "backend.tp=2", "backend.dp_shard=2"],
     ["backend.dp_replicate=1 × backend.dp_shard=2 × backend.tp=2 = 4", "not the world size 2"]),
])
def test_bad_layout_fails_on_every_rank_before_the_model_loads(tiny_model_dir, tmp_path, model_type, nproc,
                                                               overrides, needles):
    model_dir = tiny_model_dir if model_type == "llama" else save_tiny_model(tmp_path / model_type, model_type)
    result = run_cli(base_args(model_dir, tmp_path / "run", "trainer.global_batch_size=null", *overrides),
                     nproc=nproc)
    assert result.returncode != 0
    for rank in range(nproc):
        assert f"llmtrain: error on rank {rank}" in result.stderr, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr[-3000:])
    assert "Loading weights" not in result.stderr + result.stdout and not (tmp_path / "run").exists()


# ---- meta init: rank 0 builds the model, the others receive their shards ------------------------------------

@pytest.mark.parametrize("model,name,meta_ranks", [("llama", "fsdp2", "rank 1"), ("llama", "dp2_tp2", "ranks 1, 2, 3"),
                                                   ("llama", "hsdp", "ranks 1, 2, 3")])
def test_only_rank0_builds_the_model(runs, model, name, meta_ranks):
    """The parity runs above (from_pretrained folders) built the model on meta on every rank but 0."""
    assert f"fsdp2: {meta_ranks} built the model on meta, weights from rank 0" in runs.log(model, name)


def test_from_config_with_tied_embeddings_trains_as_ddp(tmp_path):
    """Random init (not a folder) on rank 0 only, and embedding / LM head tied: 3 steps as DDP's."""
    args = ["recipe=sft_tiny", "model.from_config.tie_word_embeddings=true", "trainer.eval_every_n_steps=0",
            "data.eval_files=[]", "trainer.log_every_n_steps=0", "optim.lr=1e-3", "trainer.max_steps=3",
            "trainer.grad_accum_steps=1", "trainer.global_batch_size=16", "trainer.save_every_n_steps=0"]
    metrics = {}
    for name, micro, backend in [("ddp", 8, "backend=ddp"), ("fsdp2", 8, "backend=fsdp2"),
                                 ("fsdp2_tp", 16, "backend=fsdp2_tp")]:
        result = run_cli([*args, backend, f"trainer.micro_batch_size={micro}", f"output_dir={tmp_path / name}"],
                         nproc=2)
        assert_ok(result)
        assert (name == "ddp") != ("rank 1 built the model on meta" in result.stderr)
        metrics[name] = read_metrics(tmp_path / name)[0]
    for name in ("fsdp2", "fsdp2_tp"):
        assert_close_series(metrics[name], metrics["ddp"], "loss", 1e-6, 1e-5)
        assert_close_series(metrics[name], metrics["ddp"], "grad_norm", 1e-6, 1e-5)


def test_meta_init_weights_buffers_ties_and_memory(tmp_path):
    """Worker under torchrun, 2 ranks (see `init_worker` below)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # a from_pretrained folder whose vocabulary is smaller than the tokenizer's: both paths resize
    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER_DIR)) - 7
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=vocab, **TINY)).save_pretrained(
        tmp_path / "small_vocab")
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m",
           "tests.dist.test_fsdp2", "init", str(tmp_path / "small_vocab"), str(tmp_path)]
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


# ---- the workers: `torchrun --nproc_per_node 2 -m tests.dist.test_fsdp2 MODEL_DIR STEP_DIR OUT_DIR` -------------
#                  `torchrun --nproc_per_node 2 -m tests.dist.test_fsdp2 init MODEL_DIR OUT_DIR`

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)

def worker(model_dir: Path, step_dir: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.backends.fsdp2 import FSDP2Engine
    from llmtrain.losses.lm import lm_loss_sum
    from llmtrain.parallel import ParallelDims, init_distributed, shutdown

    ctx = init_distributed("cpu", 300)
    spec = OptimizerSpec(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                         min_lr_ratio=1.0, max_grad_norm=1.0, max_steps=10)

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")

    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 16))  # (B, T), the same on every rank
    report = {"rank": ctx.rank}

    # 1. model-state bytes at dp=2: local shards of params + grads (after backward) + Adam m, v (after step)
    model = load()
    report["parameters"] = sum(p.numel() for p in model.parameters())
    dims = ParallelDims.build(1, -1, 1, ctx.world_size)
    engine = FSDP2Engine(model, spec, ctx, "fp32", dims, dims.build_mesh("cpu"))
    engine.backward(lm_loss_sum(engine.module(input_ids=ids).logits, ids) / ids.numel())
    engine.clip_or_fused_step()
    assert engine.model_state_bytes() is None  # measured once the optimizer state exists
    engine.step()
    report["bytes"] = engine.model_state_bytes()  # grads as they were before step() cleared them
    report["model_state_bytes"] = sum(report["bytes"].values())

    # 2. the dp=2 checkpoint into a tp=2 engine, exported; the export's logits vs the sharded model's
    dims = ParallelDims.build(1, -1, 2, ctx.world_size)
    engine = FSDP2Engine(load(), spec, ctx, "fp32", dims, dims.build_mesh("cpu"))
    engine.load_checkpoint(step_dir / "engines" / "policy")
    engine.export_hf(out_dir / "hf")
    with torch.no_grad():
        sharded_logits = engine.module(input_ids=ids).logits  # (B, T, V), full on every tp rank
        if ctx.is_main:
            exported = AutoModelForCausalLM.from_pretrained(out_dir / "hf", dtype=torch.float32,
                                                            attn_implementation="sdpa")
            report["export_logits_max_abs_diff"] = (exported(input_ids=ids).logits - sharded_logits).abs().max().item()
    (out_dir / f"rank_{ctx.rank}.json").write_text(json.dumps(report))
    shutdown()


def init_worker(model_dir: Path, out_dir: Path) -> None:
    """Each case built as run.py builds it (seed, the backend's init context) and wrapped, against what DDP
    builds on every rank (the same call, no context): rank 1 built on meta; rank 0's gathered full state
    dict equals DDP's bitwise; buffers (rotary inv_freq, non-persistent), weight ties and the CPU RNG state
    equal DDP's on every rank. Then a ~50M-parameter Llama: host memory growth over build + wrap per rank."""
    import contextlib
    import resource

    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.backends.fsdp2 import FSDP2Backend
    from llmtrain.models.load import build_model, load_tokenizer
    from llmtrain.parallel import init_distributed, shutdown

    ctx = init_distributed("cpu", 300)
    spec = OptimizerSpec(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                         min_lr_ratio=1.0, max_grad_norm=1.0, max_steps=10)
    tokenizer = load_tokenizer(str(TOKENIZER_DIR), False)

    def build(backend, name_or_path, from_config):
        torch.manual_seed(0)
        with backend.model_init_context() if backend is not None else contextlib.nullcontext():
            return build_model(name_or_path=name_or_path, from_config=from_config, config_path=None,
                               tokenizer=tokenizer, attn_implementation="sdpa", dropout=0.0,
                               activation_checkpointing=False, trust_remote_code=False)

    def ties(model):
        return [model.get_output_embeddings().weight is model.get_input_embeddings().weight]

    tied = dict(model_type="llama", tie_word_embeddings=True, **TINY)
    cases = {"tied_dp2": (None, tied, 1), "tied_tp2": (None, tied, 2), "resized_folder_dp2": (str(model_dir), None, 1)}
    report = {}
    for case, (name_or_path, from_config, tp) in cases.items():
        reference = build(None, name_or_path, from_config)  # what DDP builds on every rank
        rng_after_build = torch.get_rng_state()
        backend = FSDP2Backend(ctx, "fp32", {"tp": tp})
        model = build(backend, name_or_path, from_config)
        checks = {"built_on_meta": model.get_input_embeddings().weight.is_meta, "reference_ties": ties(reference)}
        engine = backend.wrap(model, spec)
        checks["rng_as_ddp"] = torch.equal(torch.get_rng_state(), rng_after_build)
        checks["ties"] = ties(engine.module)
        reference_buffers = dict(reference.named_buffers())
        checks["buffers_equal"] = all(torch.equal(buffer, reference_buffers[name])
                                      for name, buffer in engine.module.named_buffers())
        full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if ctx.is_main:
            expected = reference.state_dict()
            checks["weights_equal"] = full.keys() == expected.keys() and all(
                torch.equal(tensor, expected[key]) for key, tensor in full.items())
        report[case] = checks

    def peak_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    big = dict(model_type="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=16,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
    before = peak_rss()
    backend = FSDP2Backend(ctx, "fp32", {})
    engine = backend.wrap(build(backend, None, big), spec)
    report["memory"] = {"parameters": sum(p.numel() for p in engine.module.parameters()),
                        "init_rss_growth": peak_rss() - before}
    (out_dir / f"init_rank_{ctx.rank}.json").write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1] == "init":
        init_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        worker(*(Path(arg) for arg in sys.argv[1:4]))
