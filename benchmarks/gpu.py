"""--suite gpu: tokens/s and MFU of llmtrain (unpacked, packed) and the plain loop on one GPU, bf16.

Not run on the machine these benchmarks were written on (no GPU there): treat the first run as a test.
MFU convention (say it with the number, docs/formulas.md): useful model FLOPs only —
6·M·(non-pad tokens) + 12·L·h·Σ len² per step (M without the input embedding; attention per sample,
without the causal halving; padding counted as waste, not work) — divided by the device's dense bf16
peak (A100 312, H100/H200 989 TFLOP/s; or --peak-tflops). The FLOPs per target token are the data
set's average, so every contender is credited the same work for the same target tokens.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import common as C

GPU_MODEL = dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512,
                 tie_word_embeddings=False, use_cache=False)
GPU_BATCH_SAMPLES, GPU_BATCH_ROWS_PACKED = 64, 16
PEAK_BF16 = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((peak for key, peak in PEAK_BF16.items() if key in device_name), None)


def flops_per_target_token(samples: list[dict], params_no_embedding: int) -> float:
    h, L = GPU_MODEL["hidden_size"], GPU_MODEL["num_hidden_layers"]
    lengths = [s["length"] for s in samples]
    targets = sum(len(s["response"]) + 1 for s in samples)
    return (6 * params_no_embedding * sum(lengths) + 12 * L * h * sum(n * n for n in lengths)) / targets


def run_suite(args, work: Path, tmp: Path, info: dict) -> dict:
    import torch

    import report
    import throughput as T

    name = torch.cuda.get_device_name(0)
    model_dir = work / "gpu_model"
    params = C.save_model(model_dir, GPU_MODEL)
    embedding = len(C.tokenizer()) * GPU_MODEL["hidden_size"]
    samples = json.loads((work / "samples.json").read_text())
    per_token = flops_per_target_token(samples, params - embedding)
    peak = peak_flops(name, getattr(args, "peak_tflops", None))
    steps = args.warmup + args.steps
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")

    def llmtrain(packed: bool):
        def argv(out, first):
            run_dir = tempfile.mkdtemp(dir=tmp, prefix="gpu-")
            micro = GPU_BATCH_ROWS_PACKED if packed else GPU_BATCH_SAMPLES
            return T.llmtrain_worker_argv(out, args.warmup, T.llmtrain_overrides(
                work, Path(run_dir), steps=steps, micro_batch=micro, packing=packed, model_dir=model_dir,
                precision="bf16", extra=("device=cuda",)))
        return argv

    contenders = {
        "plain loop (bf16 autocast, sdpa)": lambda out, first: [
            sys.executable, str(T.HERE / "workers.py"), "plain", "--work", str(work), "--steps", str(steps),
            "--warmup", str(args.warmup), "--device", "cuda", "--precision", "bf16", "--batch", str(GPU_BATCH_SAMPLES),
            "--model", str(model_dir), "--out", out],
        "llmtrain unpacked": llmtrain(False),
        "llmtrain packed": llmtrain(True),
    }
    runs = T.run_rounds(contenders, args, tmp, env, suite_timeout=600)
    summary = report.summarise_cpu(runs)
    for key, entry in summary.items():
        if not key.startswith("_") and "tokens_per_s" in entry:
            entry["model_tflops"] = entry["tokens_per_s"]["median"] * per_token / 1e12
            entry["mfu"] = entry["tokens_per_s"]["median"] * per_token / peak if peak else None
    return {"runs": runs, "summary": summary, "gpu": {"name": name, "peak_bf16_flops": peak, "parameters": params,
            "model": GPU_MODEL, "flops_per_target_token": per_token,
            "mfu_convention": "6·M·tokens + 12·L·h·Σlen² (useful work, no causal halving) / dense bf16 peak"}}
