"""DeepSpeed under bf16 (2 ranks, gloo): where gradients accumulate and in which dtype they are reduced, per
ZeRO stage; the grad norm each stage reports; `export_hf` writes the fp32 masters; what loading does.

One torchrun launch runs every stage in turn: this file is also its worker
(`python -m torch.distributed.run --nproc_per_node 2 --standalone -m tests.dist.test_deepspeed_bf16 OUT`).
Each stage loads the same saved fp32 tiny Llama through the backend (ZeRO-3 under zero.Init, as run.py
does), trains 2 optimizer steps of 2 micro-batches, records after every backward the dtypes of the
buffers DeepSpeed accumulates into and of the tensors it hands to reducing collectives (torch.distributed
is wrapped before DeepSpeed starts), then saves a checkpoint and exports. bf16 is slow on CPU: the model is
a 1-layer h=32 Llama, sequences of 16 tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STAGES = (0, 1, 2, 3)  # ZeRO-3 last: its HfDeepSpeedConfig stays registered for the rest of the process
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced")
GATHERING = ("all_gather_into_tensor", "all_gather")
STEPS, ACCUM, MICRO, SEQ = 2, 2, 2, 16


# ---- the worker (runs under torchrun) ------------------------------------------------------------------------
def _record_collectives(log: list, active: list) -> None:
    import torch.distributed as dist

    def wrap(name):
        original = getattr(dist, name)

        def recorded(*args, **kwargs):
            if active[0]:
                values = list(args) + list(kwargs.values())
                tensors = [v for v in values if isinstance(v, torch.Tensor)]
                tensors += [t for v in values if isinstance(v, (list, tuple)) for t in v if isinstance(t, torch.Tensor)]
                log.append((name, sorted({str(t.dtype).removeprefix("torch.") for t in tensors})))
            return original(*args, **kwargs)
        setattr(dist, name, recorded)

    for name in REDUCING + GATHERING:
        if hasattr(dist, name):
            wrap(name)


def _accumulation_buffers(engine) -> dict[str, list]:
    """Where this stage accumulates gradients between micro-batches: name -> [dtype, holds a nonzero value]."""
    opt, found = engine.ds.optimizer, {}
    flat = getattr(opt, "grad_partitions_flat_buffer", None)  # ZeRO-3
    if isinstance(flat, torch.Tensor):
        found["grad_partitions_flat_buffer"] = [flat]
    if getattr(opt, "fp32_groups_gradients_flat", None):  # BF16_Optimizer
        found["fp32_groups_gradients_flat"] = list(opt.fp32_groups_gradients_flat)
    averaged = getattr(opt, "averaged_gradients", None)  # ZeRO-1/2 partitions
    if isinstance(averaged, dict) and averaged and not isinstance(flat, torch.Tensor):
        groups = [g.flat_partition if hasattr(g, "flat_partition") else g for g in averaged.values()]
        found["averaged_gradients"] = [t for g in groups for t in (g if isinstance(g, list) else [g])
                                       if isinstance(t, torch.Tensor)]
    accum = [p.grad_accum for p in engine.model.parameters() if getattr(p, "grad_accum", None) is not None]
    if accum:
        found["param.grad_accum"] = accum
    if not found:  # ZeRO-0: the module's own .grad
        found["param.grad"] = [p.grad for p in engine.model.parameters() if p.grad is not None]
    return {name: [sorted({str(t.dtype).removeprefix("torch.") for t in ts}), any(bool(t.ne(0).any()) for t in ts)]
            for name, ts in found.items() if ts}


def _masters(engine) -> dict[str, torch.Tensor]:
    """The fp32 masters as DeepSpeed holds them now (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    if engine.stage == 0:
        opt = engine.ds.optimizer
        by_id = {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)}
        return {n: by_id[id(p)].detach().clone() for n, p in engine.model.named_parameters()}
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.model.named_parameters()}


def _run_stage(ctx, stage: int, model_dir: Path, out: Path, log: list, active: list) -> dict:
    import deepspeed
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.backends.deepspeed import DeepSpeedBackend

    options = {"zero_stage": stage, "run": {"micro_batch_size": MICRO, "grad_accum_steps": ACCUM, "output_dir": None}}
    backend = DeepSpeedBackend(ctx, "bf16", options)
    with backend.model_init_context():  # ZeRO-3: zero.Init, as run.py builds the model
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec = OptimizerSpec(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                         min_lr_ratio=1.0, max_grad_norm=1.0, max_steps=STEPS)
    engine = backend.wrap(model, spec)
    loaded = load_file(model_dir / "model.safetensors")  # not from_pretrained: at ZeRO-3 that is partitioned
    initial = _masters(engine)
    record = {"optimizer": type(engine.ds.optimizer).__name__,
              "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in engine.model.parameters()}),
              # what the fp32 master starts from: the loaded fp32 weights, or those rounded to bf16
              "master_minus_loaded": max(float((initial[n] - loaded[n]).abs().max()) for n in initial),
              "master_minus_bf16_loaded": max(float((initial[n] - loaded[n].bfloat16().float()).abs().max())
                                              for n in initial),
              "micro": [], "grad_norm": []}
    generator = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(STEPS):
        for micro in range(ACCUM):
            ids = torch.randint(0, model.config.vocab_size, (MICRO, SEQ), generator=generator)
            with engine.no_sync(micro == ACCUM - 1):
                loss = engine.module(input_ids=ids, labels=ids).loss / (ACCUM * ctx.world_size)
                log.clear()
                active[0] = True
                engine.backward(loss)
                active[0] = False
            record["micro"].append({"buffers": _accumulation_buffers(engine),
                                    "reduced": sorted({d for name, ds in log if name in REDUCING for d in ds}),
                                    "gathered": sorted({d for name, ds in log if name in GATHERING for d in ds})})
        record["grad_norm"].append(float(engine.clip_or_fused_step()))
        engine.step()
    record["other_bytes"] = engine.model_state_bytes()["other_bytes"]
    engine.save_checkpoint(out / f"zero{stage}" / "ckpt")
    engine.export_hf(out / f"zero{stage}" / "hf")
    final = _masters(engine)
    working = {}
    for name, param in engine.model.named_parameters():  # the bf16 working copy, whole
        with deepspeed.zero.GatheredParameters([param]):
            working[name] = param.detach().clone()
    if ctx.is_main:
        torch.save({"masters": final, "working": working}, out / f"zero{stage}" / "weights.pt")
    return record


def worker(out: Path) -> None:
    log, active = [], [False]
    _record_collectives(log, active)  # before DeepSpeed's comm layer takes its references
    from llmtrain.parallel import init_distributed

    ctx = init_distributed("cpu", 300)
    records = {stage: _run_stage(ctx, stage, out / "model", out, log, active) for stage in STAGES}
    if ctx.is_main:
        (out / "records.json").write_text(json.dumps(records, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---- the tests -----------------------------------------------------------------------------------------------
pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> tuple[Path, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import REPO, assert_ok, cli_env

    out = tmp_path_factory.mktemp("deepspeed_bf16")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out / "model")  # fp32 weights, almost none representable in bf16
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "-m", "tests.dist.test_deepspeed_bf16", str(out)]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert_ok(result)
    return out, {int(k): v for k, v in json.loads((out / "records.json").read_text()).items()}


# The buffer each stage accumulates micro-batch gradients into, and its dtype (DeepSpeed 0.19.8 refuses fp32
# accumulation with bf16 weights at ZeRO-0; fp32 accumulation makes ZeRO-1 use its BF16_Optimizer).
ACCUMULATES_IN = {0: ("FP16_UnfusedOptimizer", "param.grad", "bfloat16"),
                  1: ("BF16_Optimizer", "fp32_groups_gradients_flat", "float32"),
                  2: ("DeepSpeedZeroOptimizer", "averaged_gradients", "float32"),
                  3: ("DeepSpeedZeroOptimizer_Stage3", "grad_partitions_flat_buffer", "float32")}


@pytest.mark.parametrize("stage", STAGES)
def test_gradients_accumulate_and_reduce_in_fp32(bf16_run, stage):
    record = bf16_run[1][stage]
    optimizer, buffer, dtype = ACCUMULATES_IN[stage]
    assert record["optimizer"] == optimizer and record["param_dtypes"] == ["bfloat16"]
    for i, micro in enumerate(record["micro"]):
        # after the first micro-batch the buffer already holds its gradient (accumulation happens there)
        assert micro["buffers"].get(buffer) == [[dtype], True], (i, micro["buffers"])
        assert all(dtypes == [dtype] for dtypes, _ in micro["buffers"].values()), (i, micro["buffers"])
        boundary = i % ACCUM == ACCUM - 1
        if boundary or stage >= 2:  # ZeRO-0/1 reduce once per step, ZeRO-2/3 every micro-batch
            assert micro["reduced"] == ["float32"], (i, micro)
        else:
            assert micro["reduced"] == [], (i, micro)
        if stage == 3:
            assert set(micro["gathered"]) <= {"bfloat16"}  # parameter all-gathers stay bf16
    assert record["other_bytes"] == 0  # every DeepSpeed buffer is in a named role of the model-state ledger


def test_grad_norm_agrees_across_stages(bf16_run):
    """fp32 accumulation and reduction: ZeRO-1/2/3 report the same norm (to reduction order); ZeRO-0 accumulates
    in bf16. Catches a norm read from the wrong place (BF16_Optimizer's is only set inside its step)."""
    records = bf16_run[1]
    for step in range(STEPS):
        reference = records[2]["grad_norm"][step]
        for stage in (1, 3):
            assert records[stage]["grad_norm"][step] == pytest.approx(reference, rel=1e-5), (stage, step)
        assert records[0]["grad_norm"][step] == pytest.approx(reference, rel=2e-2)


@pytest.mark.parametrize("stage", STAGES)
def test_export_writes_the_fp32_masters(bf16_run, stage):
    """hf/ holds DeepSpeed's fp32 masters after 2 steps, not the bf16 working copy (which is their rounding)."""
    from safetensors.torch import load_file

    out = bf16_run[0] / f"zero{stage}"
    exported = load_file(out / "hf" / "model.safetensors")
    weights = torch.load(out / "weights.pt", weights_only=True)
    assert set(weights["masters"]) <= set(exported)
    for name, master in weights["masters"].items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], master), name
        assert torch.equal(exported[name].bfloat16(), weights["working"][name]), name
    flat = torch.cat([t.flatten() for t in exported.values()])
    assert not torch.equal(flat, flat.bfloat16().float())  # not representable in bf16
    # config.json names the dtype written: from_pretrained's default ("auto") would otherwise cast to bf16
    assert json.loads((out / "hf" / "config.json").read_text())["dtype"] == "float32"
    if stage >= 2:  # DeepSpeed's own consolidation of the checkpoint's fp32 partitions agrees
        # (zero_to_fp32 cannot read ZeRO-1's BF16_Optimizer checkpoints: "is not a zero checkpoint")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(out / "ckpt"), tag="ds")
        for name, master in weights["masters"].items():
            assert torch.equal(consolidated[name].float(), master), name


@pytest.mark.parametrize("stage", STAGES)
def test_loaded_fp32_weights_reach_the_master_rounded_to_bf16(bf16_run, stage):
    """Measured (README): DeepSpeed casts the module to bf16 before it makes the fp32 master (ZeRO-0/1/2 in
    initialize; ZeRO-3 already in zero.Init, which from_pretrained loads into), so a loaded fp32 checkpoint
    starts training from its bf16 rounding: the low 16 bits of every weight are lost."""
    record = bf16_run[1][stage]
    assert record["master_minus_bf16_loaded"] == 0.0
    assert record["master_minus_loaded"] > 0.0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    logging.basicConfig(level=logging.WARNING)
    worker(Path(sys.argv[1]))
