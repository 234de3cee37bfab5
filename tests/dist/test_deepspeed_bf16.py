"""DeepSpeed under bf16 (2 ranks, gloo): where gradients accumulate and in which dtype they are reduced, per
ZeRO stage; the grad norm each stage reports; `export_hf` writes the fp32 masters; what loading does.

One torchrun launch runs every stage in turn: the worker tests/dist/workers/deepspeed_bf16.py
(`python -m torch.distributed.run --nproc_per_node 2 --standalone -m tests.dist.workers.deepspeed_bf16 OUT`).
Each stage loads the same saved fp32 tiny Llama through the backend (ZeRO-3 under zero.Init, as run.py
does), trains 2 optimizer steps of 2 micro-batches, records after every backward the dtypes of the
buffers DeepSpeed accumulates into and of the tensors it hands to reducing collectives (torch.distributed
is wrapped before DeepSpeed starts), then saves a checkpoint and exports. bf16 is slow on CPU: the model is
a 1-layer h=32 Llama, sequences of 16 tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.workers.deepspeed_bf16 import ACCUM, STAGES, STEPS
from tests.helpers import REPO, assert_ok, cli_env

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> tuple[Path, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("deepspeed_bf16")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out / "model")  # fp32 weights, almost none representable in bf16
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "-m", "tests.dist.workers.deepspeed_bf16", str(out)]
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
