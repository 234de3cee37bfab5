"""sft_tiny with optim=muon against optim=adamw (issue 36): steps to the same eval loss and time per step.

Both runs are `python -m llmtrain recipe=sft_tiny` with the recipe's lr and schedule (Muon: match_rms_adamw, so the
AdamW lr carries over), one process, one thread each, one after the other. The target is AdamW's eval loss at its
last step; each optimizer's figure is the step where its eval loss first reaches it (interpolated between
evaluations). Time per step: median `step_time_s` after 5 warm-up steps. Usage (~5 min on a 2-core CPU):
    python benchmarks/muon.py [--steps 150] [--eval-every 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP = 5


def run(optim: str, steps: int, eval_every: int, out: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of one sft_tiny run."""
    args = ["recipe=sft_tiny", f"optim={optim}", f"output_dir={out}", f"trainer.max_steps={steps}",
            f"trainer.eval_every_n_steps={eval_every}", "trainer.save_every_n_steps=0", "trainer.log_every_n_steps=0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="offline")
    subprocess.run([sys.executable, "-m", "llmtrain", *args], env=env, cwd=REPO, check=True, capture_output=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


def steps_to(evals: list[dict], target: float) -> float | None:
    """The step where the eval loss first reaches `target`, interpolated linearly between two evaluations."""
    for before, after in zip(evals, evals[1:]):
        if after["eval_loss"] <= target:
            drop = before["eval_loss"] - after["eval_loss"]
            share = (before["eval_loss"] - target) / drop if drop > 0 else 1.0
            return before["step"] + share * (after["step"] - before["step"])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=10)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, options.steps, options.eval_every, Path(tmp) / name) for name in ("adamw", "muon")}
    target = results["adamw"][1][-1]["eval_loss"]
    print(f"sft_tiny, {options.steps} steps, eval every {options.eval_every}; target: AdamW's final eval loss "
          f"{target:.4f}")
    print(f"{'optim':<6} {'final eval loss':>15} {'steps to target':>15} {'s/step (median)':>15}")
    for name, (train, evals) in results.items():
        reached = steps_to(evals, target)
        step_time = statistics.median(r["step_time_s"] for r in train[WARMUP:])
        shown = "not reached" if reached is None else f"{reached:.0f}"
        print(f"{name:<6} {evals[-1]['eval_loss']:>15.4f} {shown:>15} {step_time:>15.4f}")
    for name, (_, evals) in results.items():
        print(f"{name} eval losses: " + ", ".join(f"{e['step']}: {e['eval_loss']:.4f}" for e in evals))


if __name__ == "__main__":
    main()
