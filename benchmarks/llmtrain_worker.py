"""Run llmtrain's own command-line entry point (`llmtrain.__main__.main`, the code behind
`python -m llmtrain`) in this process, with measurement added around it and nothing in its hot path:

    python benchmarks/llmtrain_worker.py --out R.json --warmup W [--comm-step K] [--check-packing]
        [--profile F.prof] -- recipe=... key=value ...
    PYTHONPATH=/path/to/an/older/checkout python benchmarks/llmtrain_worker.py ...   # that checkout's llmtrain
    torchrun --standalone --nproc_per_node 2 benchmarks/llmtrain_worker.py ... -- ... backend=zero2

- each metrics.jsonl step record (one with `tokens`, or `pairs` for the reward-model and DPO stages) gets
  `wall_time` / `cpu_time` (perf_counter / process_time when rank 0 logs it): the benchmark's throughput
  window is wall clock over whole loop iterations, the same figure every other contender gets (llmtrain's
  own `tokens_per_s` / `pairs_per_s` is per step and leaves out logging); pair stages report `pairs_per_s`;
- `--comm-step K`: during optimizer step K the collectives of this rank are counted (a dispatch mode
  over the c10d ops) and its live tensor bytes taken just before the update; that step is slower and is
  left out of the throughput window (make K the last step);
- `--profile`: cProfile of the whole run;
- each rank writes its own peak RSS and `llmtrain.__file__` (R.json on rank 0, R.json.rank<r> on the
  others): whichever llmtrain `import llmtrain` finds runs, and the result says which one it was.

It works with llmtrain both before and after the batch API change that followed eff726e (collate no
longer builds the packed mask, `Batch.for_attention` does; `num_target_tokens()` became `num_targets`):
it only calls `collate`, `run.batch_preparer` (the same signature in both, the mask or attention inputs
made there) and `models.load.resolve_attn_implementation`, and wraps `Updater.update` (or, before the stage
seam, `Trainer.train_step`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


UNITS = ("tokens", "pairs", "samples")  # what a stage's step record counts (Stage.count_name; PPO/GRPO: samples)


def step_unit(record: dict) -> str | None:
    return next((unit for unit in UNITS if unit in record), None)


def install_clock() -> None:
    from llmtrain.metrics import sinks

    original = sinks.JsonlSink.log

    def log(self, record):
        if step_unit(record):  # a training step's record (SFT/pretrain: tokens; reward model, DPO: pairs)
            record = dict(record, wall_time=time.perf_counter(), cpu_time=time.process_time())
        return original(self, record)

    sinks.JsonlSink.log = log


def install_comm_probe(step: int, found: dict) -> None:
    """Count this rank's collectives during optimizer step `step` (1-based) and its tensor bytes."""
    try:  # the stage seam: every optimizer step goes through Updater.update
        from llmtrain.stages.base import Updater as Owner
        name, clip_name = "update", "clip_or_fused_step"
        current = lambda self, args: self.step  # noqa: E731
        engine_of = lambda self, args: args[0]  # noqa: E731
    except ImportError:  # before it: Trainer.train_step(micro_batches[, start]) over self.engine
        from llmtrain.trainer import Trainer as Owner
        name, clip_name = "train_step", "clip_grad_norm"
        current = lambda self, args: self.step + 1  # noqa: E731
        engine_of = lambda self, args: self.engine  # noqa: E731
    original = getattr(Owner, name)

    def probed(self, *args, **kwargs):
        if current(self, args) != step:
            return original(self, *args, **kwargs)
        engine = engine_of(self, args)
        clip = getattr(engine, clip_name)

        def clip_and_measure():  # gradients exist, the update has not run: weights + grads + optimizer
            found["live_tensor_bytes_before_update"] = C.live_tensor_bytes()
            return clip()

        setattr(engine, clip_name, clip_and_measure)
        counter = C.comm_counter()
        try:
            with counter:
                result = original(self, *args, **kwargs)
        finally:
            delattr(engine, clip_name)
        found["comm_calls"], found["comm_bytes"] = dict(counter.calls), dict(counter.bytes)
        found["live_tensor_bytes_after_update"] = C.live_tensor_bytes()
        return result

    setattr(Owner, name, probed)


def output_dir(overrides: list[str]) -> Path:
    return Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")))


def packing_check(overrides: list[str]) -> dict:
    """llmtrain's packed path (its data pipeline, collate and batch preparation) on the exported weights."""
    import torch

    from llmtrain.data.collate import collate
    from llmtrain.data.pipeline import build_data
    from llmtrain.models.load import load_tokenizer
    from llmtrain.run import batch_preparer
    from workers import isolation_check

    kv = dict(o.split("=", 1) for o in overrides)
    tok = load_tokenizer(str(C.TOKENIZER_DIR), False)
    data = build_data(train_files=[kv["data.train_files"].strip("[]")], eval_files=[], dataset=None, split="train",
                      eval_split=None, eval_fraction=0.0, fmt="prompt_response", max_seq_len=C.MAX_SEQ_LEN,
                      overlong="truncate", packing=True, tokenizer=tok, seed=0)
    batch = collate([data.train[i] for i in range(C.GLOBAL_BATCH_ROWS_PACKED)], pad_token_id=tok.pad_token_id)
    from transformers import AutoModelForCausalLM

    from llmtrain.models import load

    # what the run trained with: "sdpa" with collate's dense block mask (eff726e and before), or llmtrain's own
    # "sdpa_segments" (registered with transformers by name; the batch carries the sample lengths)
    attn = load.resolve_attn_implementation("auto", torch.device("cpu"))
    register = getattr(load, "register_segment_attention", None)
    if register is not None:
        register()
    batch = batch_preparer(torch.device("cpu"), "fp32", attn)(batch)  # old: the mask in fp32; new: for_attention
    model = AutoModelForCausalLM.from_pretrained(output_dir(overrides) / "hf", dtype=torch.float32,
                                                 attn_implementation=attn)
    found = isolation_check(model, batch.model_inputs(), batch.input_ids, batch.labels, batch.position_ids,
                            tok.eos_token_id)
    return dict(found, attn_implementation=attn)


def summarise(overrides: list[str], warmup: int, comm_step: int | None) -> dict:
    records = [json.loads(line) for line in open(output_dir(overrides) / "metrics.jsonl")]
    steps = [r for r in records if step_unit(r)]
    if comm_step is not None:  # the counted step runs under a dispatch mode: not timed
        steps = [r for r in steps if r["step"] < comm_step]
    unit = step_unit(steps[0])
    if unit == "samples":  # PPO / GRPO: steps/s, generated tokens/s, the stage's own time split
        return rl_summary(steps, warmup)
    result = C.window_throughput([r["wall_time"] for r in steps], [r[unit] for r in steps], warmup,
                                 [r["cpu_time"] for r in steps])
    if unit == "pairs":  # the same window, counted in pairs (reward model, DPO)
        result = C.in_pairs(result)
    # llmtrain's own figure: count / step_time_s (since fac5d8f the step's clock includes fetching the batch)
    own = sorted(r[f"{unit}_per_s"] for r in steps[warmup:])
    result[f"self_reported_{unit}_per_s_median"] = own[len(own) // 2]
    timed = steps[warmup:]
    result[f"self_reported_{unit}_per_s_overall"] = sum(r[unit] for r in timed) / sum(r["step_time_s"] for r in timed)
    result["step_time_fraction_of_loop"] = sum(r["step_time_s"] for r in timed) / result["measured_s"]
    result["first_loss"], result["last_loss"] = steps[0]["loss"], steps[-1]["loss"]
    result["losses"] = [r["loss"] for r in steps]
    memory = {k: v for r in records for k, v in r.items() if k.startswith("memory_")}
    if memory:
        result["logged_memory"] = memory
    return result


def rl_summary(steps: list[dict], warmup: int) -> dict:
    """PPO / GRPO step records: steps/s and generated tokens/s (response_len x samples: tokens through the first
    EOS) over the same wall-clock window, and the mean of the stage's time split over the timed steps."""
    from ppo import SPLIT, window

    timed = steps[warmup:]
    result = window([r["wall_time"] for r in steps], [r["response_len"] * r["samples"] for r in steps], warmup,
                    [r["cpu_time"] for r in steps])
    result["split"] = {k: sum(r[k] for r in timed) / len(timed) for k in (*SPLIT, "time_gather_s", "generation_share")}
    result["scores"], result["losses"] = [r["score"] for r in steps], [r["loss"] for r in steps]
    result["first_ratio_dev_max"] = max(r.get("first_ratio_dev", 0.0) for r in steps)  # absent on the shortcut
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--comm-step", type=int)
    parser.add_argument("--check-packing", action="store_true")
    parser.add_argument("--profile")
    parser.add_argument("overrides", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    overrides = [o for o in args.overrides if o != "--"]
    C.set_threads()
    import llmtrain
    from llmtrain.__main__ import main as llmtrain_main

    install_clock()
    found: dict = {}
    if args.comm_step:
        install_comm_probe(args.comm_step, found)
    start = time.perf_counter()
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
        rc = profiler.runcall(llmtrain_main, overrides)
        profiler.dump_stats(f"{args.profile}.rank{RANK}" if RANK else args.profile)
    else:
        rc = llmtrain_main(overrides)
    result = {"rc": rc, "rank": RANK, "wall_s": time.perf_counter() - start, "llmtrain_file": llmtrain.__file__,
              **found}
    if rc == 0 and RANK == 0:
        result.update(summarise(overrides, args.warmup, args.comm_step))
        if args.check_packing:
            result["isolation"] = packing_check(overrides)
    C.write_result(args.out if RANK == 0 else f"{args.out}.rank{RANK}", result)
    sys.exit(rc)


if __name__ == "__main__":
    main()
