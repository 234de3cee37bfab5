"""Run under torchrun by tests/dist/test_deepspeed_bf16.py, 2 ranks (gloo):
`python -m torch.distributed.run --nproc_per_node 2 --standalone -m tests.dist.workers.deepspeed_bf16 OUT`.

Every ZeRO stage in turn loads the saved fp32 tiny Llama OUT/model through the backend in bf16, trains 2 optimizer
steps of 2 micro-batches, records after every backward where gradients accumulate and the dtypes handed to
reducing and gathering collectives, saves a checkpoint and exports; rank 0 writes OUT/records.json and
OUT/zero<stage>/weights.pt.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

STAGES = (0, 1, 2, 3)  # ZeRO-3 last: its HfDeepSpeedConfig stays registered for the rest of the process
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced")
GATHERING = ("all_gather_into_tensor", "all_gather")
STEPS, ACCUM, MICRO, SEQ = 2, 2, 2, 16


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
    from llmtrain.distributed import init_distributed

    ctx = init_distributed("cpu", 300)
    records = {stage: _run_stage(ctx, stage, out / "model", out, log, active) for stage in STAGES}
    if ctx.is_main:
        (out / "records.json").write_text(json.dumps(records, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    logging.basicConfig(level=logging.WARNING)
    worker(Path(sys.argv[1]))
