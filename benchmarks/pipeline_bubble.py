"""The pipeline's measured bubble next to the formula, and its activations in flight, on 2 ranks (backend.pp=2).

    python benchmarks/pipeline_bubble.py [--layers 4] [--hidden 256] [--seq 128] [--rows 2] [--steps 3]

Each (schedule, M) runs llmtrain's PipelineEngine (backends/pipeline_engine.py) under torchrun in this file's
`--worker` mode on a Llama built from a config, and times every stage's forward and backward slot
(`forward_one_chunk` / `backward_one_chunk` of torch's PipelineStage; the p2p waits fall between slots). Per rank:
measured bubble = 1 − (Σ slot time) / (step time), next to (P−1)/(v·M+P−1); the peak count of micro-batch chunks
whose activations are alive (forwards done − backwards done) times the bytes one chunk's forward saves for backward
(autograd's saved-tensor hooks, llmtrain/metrics/live.py) is the peak activation memory: GPipe holds M, 1F1B P−r.
Step times are the median of `--steps` steps after two warm-up steps. On a shared 2-core CPU the slots are noisy;
the in-flight counts are exact.

Measured (2 CPU cores shared with other jobs, torch 2.13.0+cpu, gloo; Llama L4 h256 s128, 2 rows per micro-batch;
bubble rank 0 / rank 1 against the formula; chunks in flight rank 0 / rank 1, MiB of activations rank 0 / rank 1):
    schedule     M  bubble r0 / r1 (formula)  in flight r0 / r1  MiB r0 / r1
    gpipe        2  37% / 36% (33%)           2 / 2              21 / 23
    gpipe        4  29% / 29% (20%)           4 / 4              42 / 45
    gpipe        8  23% / 21% (11%)           8 / 8              85 / 91
    1f1b         2  27% / 33% (33%)           2 / 1              21 / 11
    1f1b         4  31% / 21% (20%)           2 / 1              21 / 11
    1f1b         8  25% / 19% (11%)           2 / 1              21 / 11
    interleaved  2  41% / 38% (20%)           4 / 3              21 / 18
    interleaved  4  26% / 24% (11%)           5 / 3              27 / 18
    interleaved  8  15% / 14% (6%)            5 / 3              27 / 18
The bubble falls with M as the formula says, a few points above it: gloo's send/recv on the CPU (between the timed
slots) and the shared cores. GPipe's activations grow with M; 1F1B's stay at P−r micro-batches (2 / 1), interleaved
at torch's warm-up count of half-stage chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]


def instrument(stage, clock: dict) -> None:
    """Time the stage's compute slots and count its chunks in flight (instance attributes: this benchmark only)."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            clock["busy"] += time.perf_counter() - start
            clock["alive"] += 1
            clock["peak"] = max(clock["peak"], clock["alive"])

    def timed_backward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return backward(*args, **kwargs)
        finally:
            clock["busy"] += time.perf_counter() - start
            clock["alive"] -= 1

    stage.forward_one_chunk, stage.backward_one_chunk = timed_forward, timed_backward


def worker(args) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.backends.pipeline_engine import PipelineEngine
    from llmtrain.data.collate import collate
    from llmtrain.distributed import init_distributed
    from llmtrain.metrics.live import SavedTensorMeter
    from llmtrain.parallel import ParallelDims
    from llmtrain.stages.causal_lm import CausalLMStage

    ctx = init_distributed("cpu", 600)
    torch.manual_seed(0)
    arch = AutoConfig.for_model("llama", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=args.layers,
                                vocab_size=256, tie_word_embeddings=False, use_cache=False)
    model = AutoModelForCausalLM.from_config(arch, attn_implementation="sdpa")
    dims = ParallelDims.build(ctx.world_size, pp=ctx.world_size).on("cpu")
    optim = OptimizerSpec(lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                          min_lr_ratio=0.0, max_grad_norm=1.0, max_steps=100)
    engine = PipelineEngine(model, optim, ctx, "fp32", dims, schedule=args.schedule, virtual_stages=args.virtual,
                            microbatches=args.m, seq_len=args.seq, micro_batch_size=args.rows)
    schedule = engine.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    clock = {"busy": 0.0, "alive": 0, "peak": 0}
    for stage in stages:
        instrument(stage, clock)
    meter = SavedTensorMeter(engine.parts)
    examples = [{"input_ids": list(range(1, args.seq + 1)), "labels": list(range(1, args.seq + 1))}] * args.rows
    micro_batches = [collate(examples, pad_token_id=0) for _ in range(args.m)]
    inverse = 1.0 / (sum(b.num_targets for b in micro_batches))
    steps, busy, peak = [], [], 0
    for step in range(2 + args.steps):
        clock.update(busy=0.0, alive=0, peak=0)
        torch.distributed.barrier()
        start = time.perf_counter()
        with meter.watch() if step == 1 else _nothing():
            engine.run_schedule(micro_batches, CausalLMStage.micro_batch_loss, inverse, 0.0, 2)
        elapsed = time.perf_counter() - start
        engine.optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            steps.append(elapsed)
            busy.append(clock["busy"])
            peak = max(peak, clock["peak"])
    step_s, busy_s = statistics.median(steps), statistics.median(busy)
    chunk_bytes = meter.peak  # the largest single forward's saved bytes on this rank (one chunk)
    out = {"rank": ctx.rank, "step_s": step_s, "busy_s": busy_s, "bubble": 1 - busy_s / step_s,
           "in_flight": peak, "activation_bytes": peak * chunk_bytes}
    Path(args.out, f"rank{ctx.rank}.json").write_text(json.dumps(out))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--virtual", type=int, default=1)
    parser.add_argument("--m", type=int, default=4)
    args = parser.parse_args()
    if args.worker:
        return worker(argparse.Namespace(**json.loads(os.environ["PIPELINE_BUBBLE"])))
    from llmtrain.plan.pp import bubble_fraction

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    print(f"{'schedule':>17} {'M':>2} {'rank':>4} {'step s':>7} {'bubble':>7} {'formula':>7} {'in flight':>9} "
          f"{'activations MiB':>15}")
    for schedule, virtual in RUNS:
        for m in (2, 4, 8):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
                   "--worker"]  # the worker's settings travel in the environment (torchrun parses what follows)
            with tempfile.TemporaryDirectory() as out:  # one JSON per rank (their stdout lines interleave)
                settings = {**vars(args), "schedule": schedule, "virtual": virtual, "m": m, "worker": True, "out": out}
                done = subprocess.run(cmd, env={**env, "PIPELINE_BUBBLE": json.dumps(settings)}, capture_output=True,
                                      text=True, cwd=REPO)
                results = [json.loads(f.read_text()) for f in sorted(Path(out).glob("rank*.json"))]
            if done.returncode != 0 or not results:
                print(f"{schedule} M={m}: failed\n{done.stderr[-2000:]}")
                continue
            for r in sorted(results, key=lambda r: r["rank"]):
                print(f"{schedule:>17} {m:>2} {r['rank']:>4} {r['step_s']:>7.3f} {r['bubble']:>7.1%} "
                      f"{bubble_fraction(2, m, virtual):>7.1%} {r['in_flight']:>9} "
                      f"{r['activation_bytes'] / 2**20:>15.1f}")


if __name__ == "__main__":
    main()
