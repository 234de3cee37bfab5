"""Run under torchrun by tests/dist/test_fsdp2.py, 2 ranks, for what the CLI cannot show:

- `torchrun --nproc_per_node 2 -m tests.dist.workers.fsdp2_checks MODEL_DIR STEP_DIR OUT_DIR` (`worker`): the
  model-state bytes at dp=2, a dp=2 checkpoint loaded at tp=2 and exported, the export's logits against the
  sharded model's; OUT_DIR/rank_<r>.json and OUT_DIR/hf.
- `torchrun --nproc_per_node 2 -m tests.dist.workers.fsdp2_checks init MODEL_DIR OUT_DIR` (`init_worker`): meta
  init against what DDP builds, and each rank's host memory growth; OUT_DIR/init_rank_<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers import TOKENIZER_DIR

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)


def worker(model_dir: Path, step_dir: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.backends.fsdp2 import FSDP2Engine
    from llmtrain.distributed import init_distributed, shutdown
    from llmtrain.losses.lm import lm_loss_sum
    from llmtrain.parallel import ParallelDims

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
    dims = ParallelDims.build(ctx.world_size)
    engine = FSDP2Engine(model, spec, ctx, "fp32", dims.on("cpu"))
    engine.backward(lm_loss_sum(engine.module(input_ids=ids).logits, ids) / ids.numel())
    engine.clip_or_fused_step()
    assert engine.model_state_bytes() is None  # measured once the optimizer state exists
    engine.step()
    report["bytes"] = engine.model_state_bytes()  # grads as they were before step() cleared them
    report["model_state_bytes"] = sum(report["bytes"].values())

    # 2. the dp=2 checkpoint into a tp=2 engine, exported; the export's logits vs the sharded model's
    dims = ParallelDims.build(ctx.world_size, tp=2)
    engine = FSDP2Engine(load(), spec, ctx, "fp32", dims.on("cpu"))
    engine.load_checkpoint(step_dir / "engines" / "policy")
    engine.export_hf(out_dir / "hf")
    with torch.no_grad():
        sharded_logits = engine.module(input_ids=ids).logits  # (B, T, V), full on every tp rank
        if ctx.is_main:
            exported = AutoModelForCausalLM.from_pretrained(out_dir / "hf", dtype=torch.float32,
                                                            attn_implementation="sdpa")
            report["export_logits_max_abs_diff"] = (exported(input_ids=ids).logits - sharded_logits).abs().max().item()

    # 3. optim=muon on DDP, FSDP2 (+ tp) and ZeRO-1/2/3 against one-process torch.optim.Muon, in this launch
    from tests.dist.workers.muon_checks import muon_exactness

    report["muon_max_abs_diff"] = muon_exactness(ctx, model_dir)
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
    from llmtrain.distributed import init_distributed, shutdown
    from llmtrain.models.load import build_model, load_tokenizer

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
