"""The GPU paths, on ONE GPU (world size 1), in about 5 minutes: `python -m pytest -q tests/gpu`.

Skipped without CUDA (the reason is printed). What a CPU cannot show: bf16 on every backend (DDP autocast,
FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16 engine with fp32 gradient accumulation), FSDP2 cpu_offload
(its grad norm over CPU shards needs the gloo side of the process group), flash-attention varlen for packed
rows, fp32 with flash-attn installed, DeepSpeed's bf16 export of the fp32 masters, and the frozen DPO
reference in bf16 (step 1's loss must still be ln 2 exactly: the reference computes what the policy does), and PPO's
bf16 rollouts (left-padded prompts under flash-attention/sdpa, ZeRO-3 gathered and FSDP2 unsharded generation).
Multi-rank NCCL parity needs more than one GPU and stays on paper here. So does Ulysses sequence parallelism
(backend.sp > 1): one GPU cannot run it (sp ranks share each row); its exactness is checked on CPU ranks with gloo
(tests/dist/test_sequence_parallel.py), its NCCL all-to-all is not.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from tests.helpers import assert_ok, read_metrics, run_cli, save_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU paths need one")

BF16_STEPS = ["recipe=sft_tiny", "device=cuda", "precision=bf16", "trainer.max_steps=8", "trainer.eval_every_n_steps=0",
              "trainer.save_every_n_steps=0", "trainer.log_every_n_steps=0", "optim.lr=1e-3", "model.from_config=null",
              "model.tokenizer=null"]
BACKENDS = {"ddp": [], "fsdp2": ["backend=fsdp2"], "fsdp2_offload": ["backend=fsdp2", "backend.cpu_offload=true"],
            "zero2": ["backend=zero2"], "zero3": ["backend=zero3"]}
BF16_REL = 2e-2  # bf16 rounds each op to 8 bits of mantissa: backends reduce in other orders


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("gpu_model"))


@pytest.fixture(scope="module")
def bf16_runs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    runs = {}
    for name, extra in BACKENDS.items():
        result = run_cli([*BF16_STEPS, f"model.name_or_path={model_dir}", *extra, f"output_dir={root / name}"])
        assert_ok(result)
        runs[name] = root / name
    return runs


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "ddp"])
def test_bf16_losses_track_ddp(bf16_runs, backend):
    reference, ours = read_metrics(bf16_runs["ddp"])[0], read_metrics(bf16_runs[backend])[0]
    for a, b in zip(ours, reference):
        assert abs(a["loss"] - b["loss"]) <= BF16_REL * b["loss"], (backend, a["step"], a["loss"], b["loss"])
    assert ours[-1]["loss"] < ours[0]["loss"]


@pytest.mark.parametrize("backend", ["zero2", "zero3"])
def test_deepspeed_bf16_export_holds_fp32_masters(bf16_runs, backend):
    from safetensors.torch import load_file

    config = json.loads((bf16_runs[backend] / "hf" / "config.json").read_text())
    weights = load_file(bf16_runs[backend] / "hf" / "model.safetensors")
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert all(t.dtype == torch.float32 for t in weights.values())
    matrix = next(t for k, t in weights.items() if k.endswith("q_proj.weight"))
    assert not torch.equal(matrix, matrix.bfloat16().float())  # not a bf16 working copy widened


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_varlen_packed_equals_unpacked(model_dir):
    """Packed rows through flash-attention varlen (cu_seq_lens from the batch): each sample's logits equal the
    sample run alone; and `auto` picks flash-attention for bf16 on this GPU."""
    from transformers import AutoModelForCausalLM

    from llmtrain.data.collate import collate
    from llmtrain.data.packing import merge_packed
    from llmtrain.models.load import resolve_attn_implementation

    assert resolve_attn_implementation("auto", torch.device("cuda", 0), "bf16") == "flash_attention_2"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2").cuda().eval()
    samples = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in (7, 12, 5)]
    packed_batch = collate([merge_packed(samples)], pad_token_id=0).to("cuda").for_attention("flash_attention_2")
    with torch.no_grad():
        packed_logits = model(**packed_batch.model_inputs()).logits[0]  # (N, V)
        start = 0
        for sample in samples:
            n = len(sample["input_ids"])
            alone = model(input_ids=torch.tensor([sample["input_ids"]], device="cuda")).logits[0]
            torch.testing.assert_close(packed_logits[start:start + n].float(), alone.float(), rtol=2e-2, atol=2e-2)
            start += n


def test_fp32_with_flash_attn_installed_runs_sdpa(model_dir, tmp_path):
    args = [*BF16_STEPS, "precision=fp32", "trainer.max_steps=2", f"model.name_or_path={model_dir}",
            f"output_dir={tmp_path}"]
    assert_ok(run_cli(args))
    assert math.isfinite(read_metrics(tmp_path)[0][-1]["loss"])


@pytest.mark.parametrize("backend", ["ddp", "zero2", "fsdp2"])
def test_dpo_in_bf16_starts_at_ln2(model_dir, tmp_path, backend):
    """The frozen reference in bf16 computes exactly what the bf16 policy computes before its first update."""
    args = ["recipe=dpo_tiny", "device=cuda", "precision=bf16", "trainer.max_steps=2", "trainer.eval_every_n_steps=0",
            "trainer.save_every_n_steps=0", f"model.name_or_path={model_dir}", *BACKENDS[backend],
            f"output_dir={tmp_path}"]
    assert_ok(run_cli(args))
    first = read_metrics(tmp_path)[0][0]
    assert abs(first["loss"] - math.log(2)) < 1e-6 and first["reward_margin"] == 0


@pytest.mark.parametrize("backend", ["ddp", "zero3", "fsdp2"])
def test_ppo_in_bf16_generates_and_keeps_the_first_ratio_at_one(model_dir, tmp_path, backend):
    """bf16 rollouts on the GPU (flash-attention or sdpa with left-padded prompts), ZeRO-3's gathered generation and
    FSDP2's unsharded one: the experience's forwards are the update's, so the first ratio is exactly 1 in bf16 too,
    and the reference (the initial actor, bf16 like it) gives KL 0 at the first iteration."""
    args = ["recipe=ppo_tiny", "device=cuda", "precision=bf16", "trainer.max_steps=2", "trainer.eval_every_n_steps=0",
            "trainer.save_every_n_steps=0", "ppo.rollout.prompts_per_step=8", "ppo.mini_batch_size=8",
            f"model.name_or_path={model_dir}", *BACKENDS[backend], f"output_dir={tmp_path}"]
    assert_ok(run_cli(args))
    train = read_metrics(tmp_path)[0]
    assert [r["first_ratio_dev"] for r in train] == [0.0, 0.0] and train[0]["kl"] == 0.0
    assert all(math.isfinite(r["policy_loss"]) and math.isfinite(r["value_loss"]) for r in train)
