"""Asynchronous rollouts (ppo.off_policy.max_staleness=1) against the on-policy loop (0), engine=vllm: the vLLM server
on one core, the trainer on the other; every run starts its own server (`ppo.rollout.vllm.python` = rollout.py's
wrapper that execs the engine interpreter under `taskset -c 1`), the trainer runs under `taskset -c 0`.

    python benchmarks/async_rollouts.py [--speed-steps 6] [--warmup 2] [--quality-steps 30] [--seeds 1 2]
                                        [--speed-order 1 0] [--skip-speed] [--skip-quality]
                                        [--out benchmarks/results/async_rollouts.json]

- speed: rollout.py's GRPO iteration (ROLLOUT_MODEL, 27.7M Llama, 8 prompts x 4 samples of up to 128 tokens, one
  optimizer step), k=0 and k=1; the median `step_time_s` after `--warmup` steps. Goal: k=0 / k=1 >= 1.4. Overlap
  hides at most the shorter of the rollout and the rest (the bound printed: k=0's iteration over its longer part).
- quality: recipe=grpo_tiny (the sft_tiny base on the reversal task) for `--quality-steps` iterations per seed, k=0
  and k=1; the held-out greedy exact match after the same number of updates (the final eval), per seed.
Figures are printed and written to --out (raw records too). The machine's other load is printed beside them.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo  # noqa: E402
import rollout  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def run_llmtrain(overrides: list[str], out_dir: Path, timeout: int) -> tuple[list[dict], list[dict], float]:
    """`taskset -c TRAINER_CORE python -m llmtrain ...` -> (train records, eval records, wall seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(["taskset", "-c", rollout.TRAINER_CORE, sys.executable, "-m", "llmtrain", *overrides],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"llmtrain failed ({proc.returncode}): {proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line]
    return ([r for r in records if "loss" in r], [r for r in records if "eval_exact_match" in r], wall)


def load_average() -> float:
    return os.getloadavg()[0]


def speed(args, work: Path) -> dict:
    rollout.set_constants()
    model = work / "rollout-model"
    rollout.save_model(model, *[rollout.ROLLOUT_MODEL[k] for k in ("hidden_size", "num_hidden_layers",
                                                                   "num_attention_heads", "intermediate_size")])
    steps = args.warmup + args.speed_steps
    prompts = ppo.write_prompts(work, steps * rollout.PROMPTS_PER_STEP * 2)
    rows = {}
    for k in args.speed_order:  # alternate the order between invocations: the machine's load drifts
        out = Path(tempfile.mkdtemp(dir=work, prefix=f"speed-k{k}-"))
        overrides = [*rollout.llmtrain_overrides("vllm", str(model), prompts, out, steps, work),
                     f"ppo.off_policy.max_staleness={k}"]
        load = load_average()
        train, _, wall = run_llmtrain(overrides, out, 1800)
        timed = [r["step_time_s"] for r in train[args.warmup:]]
        rows[k] = {"step_time_s": [r["step_time_s"] for r in train], "median_step_s": statistics.median(timed),
                   "time_rollout_s": statistics.median(r["time_rollout_s"] for r in train[args.warmup:]),
                   "time_update_s": statistics.median(r["time_update_s"] for r in train[args.warmup:]),
                   "trainer_wait_s": [r.get("trainer_wait_s") for r in train],
                   "engine_idle_s": [r.get("engine_idle_s") for r in train],
                   "response_len": statistics.mean(r["response_len"] for r in train), "wall_s": wall,
                   "load_average_before": load}
        print(f"speed k={k}: median iteration {rows[k]['median_step_s']:.2f} s (rollout wait "
              f"{rows[k]['time_rollout_s']:.2f}, update {rows[k]['time_update_s']:.2f}, mean response "
              f"{rows[k]['response_len']:.1f} tokens; load before {load:.1f})", flush=True)
    rows["speedup"] = rows[0]["median_step_s"] / rows[1]["median_step_s"]
    # the most overlap can give: the k=0 iteration over its longer part, the rollout or everything else
    rollout_s = rows[0]["time_rollout_s"]
    rows["bound"] = rows[0]["median_step_s"] / max(rollout_s, rows[0]["median_step_s"] - rollout_s)
    rows["rollout_hidden"] = (rows[0]["median_step_s"] - rows[1]["median_step_s"]) / rollout_s
    print(f"speed: k=0 / k=1 iteration time = {rows['speedup']:.2f}x (goal >= 1.4; at most {rows['bound']:.2f}x with "
          f"this split: the rollout is {rollout_s / rows[0]['median_step_s']:.0%} of a k=0 iteration); "
          f"{rows['rollout_hidden']:.0%} of the k=0 rollout time hidden", flush=True)
    return rows


def quality(args, work: Path) -> dict:
    rows = {}
    for k in (0, 1):
        for seed in args.seeds:
            out = Path(tempfile.mkdtemp(dir=work, prefix=f"quality-k{k}-s{seed}-"))
            overrides = ["recipe=grpo_tiny", "ppo.rollout.engine=vllm",
                         f"ppo.rollout.vllm.python={rollout.engine_wrapper(work)}",
                         f"trainer.max_steps={args.quality_steps}", f"trainer.eval_every_n_steps={args.quality_steps}",
                         f"trainer.seed={seed}", f"ppo.off_policy.max_staleness={k}", f"output_dir={out}"]
            train, evals, wall = run_llmtrain(overrides, out, 3600)
            rows[f"k{k}-seed{seed}"] = {"k": k, "seed": seed,
                                        "eval_exact_match": [e["eval_exact_match"] for e in evals],
                                        "score_last5": statistics.mean(r["score"] for r in train[-5:]),
                                        "median_step_s": statistics.median(r["step_time_s"] for r in train[1:]),
                                        "wall_s": wall}
            row = rows[f"k{k}-seed{seed}"]
            print(f"quality k={k} seed={seed}: exact match {row['eval_exact_match']} (step 0 -> "
                  f"{args.quality_steps}), score over the last 5 {row['score_last5']:.3f}, median iteration "
                  f"{row['median_step_s']:.2f} s", flush=True)
    for k in (0, 1):
        final = [rows[f"k{k}-seed{s}"]["eval_exact_match"][-1] for s in args.seeds]
        rows[f"k{k}"] = {"final_exact_match": final, "min": min(final), "max": max(final)}
        print(f"quality k={k}: final exact match over seeds {final}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed-steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quality-steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--speed-order", type=int, nargs=2, default=[0, 1], choices=[0, 1])
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async_rollouts.json"))
    args = parser.parse_args()
    result = {"args": vars(args), "load_average_start": load_average()}
    with tempfile.TemporaryDirectory(prefix="async-rollouts-") as tmp:
        work = Path(tmp)
        if not args.skip_speed:
            result["speed"] = speed(args, work)
        if not args.skip_quality:
            result["quality"] = quality(args, work)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
