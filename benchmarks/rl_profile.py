"""Where an llmtrain GRPO iteration spends its time, and the most any change to llmtrain's own code could gain
(Amdahl): the work a peer trainer does too (the transformers model's forward, autograd's backward, torch's
optimizer step) against everything else (llmtrain's sampling loop, losses, bookkeeping, the reward function).

    python benchmarks/rl_profile.py [--steps 60] [--warmup 5] [--prof F.prof]   # ~1 min; --prof: read, do not run

It runs the ppo suite's `llmtrain grpo` contender (benchmarks/ppo.py: the same overrides) under cProfile in
`llmtrain_worker.py` and splits the training loop (`Trainer.fit`). cProfile slows Python-heavy code more than
the tensor kernels, so the share of llmtrain's own code printed here is, if anything, too high.
"""

from __future__ import annotations

import argparse
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import ppo  # noqa: E402


def profile_grpo(steps: int, warmup: int, work: Path) -> Path:
    prompts = ppo.write_prompts(work, 1000)
    overrides = ppo.llmtrain_overrides("grpo", ppo.sft_tiny_base(), prompts, work / "run", warmup + steps)
    prof = work / "grpo.prof"
    subprocess.run([sys.executable, str(C.REPO / "benchmarks" / "llmtrain_worker.py"), "--out", str(work / "r.json"),
                    "--warmup", str(warmup), "--profile", str(prof), "--", *overrides], check=True, cwd=C.REPO)
    return prof


def cumulative(stats: dict, matches) -> tuple[float, int]:
    """(seconds, calls) of the one function `matches(file, name)` selects with the largest cumulative time."""
    found = [(value[3], value[1]) for (file, _, name), value in stats.items() if matches(file, name)]
    return max(found, default=(0.0, 0))


def split(prof: Path) -> dict:
    stats = pstats.Stats(str(prof)).stats
    loop, _ = cumulative(stats, lambda f, n: f.endswith("llmtrain/trainer.py") and n == "fit")
    iterations = cumulative(stats, lambda f, n: f.endswith("stages/ppo/stage.py") and n == "train_step")[1]
    # the outermost model call: every rollout, experience and update forward goes through *ForCausalLM.forward
    model, _ = cumulative(stats, lambda f, n: "transformers/models/" in f and n == "forward")
    backward, _ = cumulative(stats, lambda f, n: f.endswith("torch/autograd/graph.py") and n == "_engine_run_backward")
    optimizer, _ = cumulative(stats, lambda f, n: "torch/optim/" in f and n == "step")
    shared = model + backward + optimizer
    return {"iterations": iterations, "loop_s": loop, "model_forward_s": model, "backward_s": backward,
            "optimizer_s": optimizer, "shared_share": shared / loop, "own_share": 1 - shared / loop,
            "bound_if_own_code_took_no_time": loop / shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prof", type=Path, help="a cProfile of an llmtrain_worker.py run to read instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = split(args.prof or profile_grpo(args.steps, args.warmup, Path(tmp)))
    per = figures["loop_s"] / max(figures["iterations"], 1)
    print(f"llmtrain grpo (the ppo suite's settings), {figures['iterations']} iterations, {per * 1e3:.0f} ms each "
          f"under cProfile:")
    for key in ("model_forward_s", "backward_s", "optimizer_s"):
        print(f"  {key[:-2]:>14}: {figures[key]:6.2f} s  ({figures[key] / figures['loop_s']:.0%})")
    print(f"  llmtrain's own: {figures['loop_s'] * figures['own_share']:6.2f} s  ({figures['own_share']:.0%})")
    print(f"the most a faster llmtrain could gain with the same model code: "
          f"{figures['bound_if_own_code_took_no_time']:.2f}x")


if __name__ == "__main__":
    main()
