"""Where an llmtrain GRPO iteration spends its time, and the most any change to llmtrain's own code could gain
(Amdahl). One accounting, three parts of the training loop (`Trainer.fit`):
- shared: the work a peer trainer does too, in the same library code: the transformers model's forward (less the
  fused LM head's own code, below), autograd's backward, torch's optimizer step, and the LM head's matmuls inside
  the fused head (`chunk_logits`, `accumulate_linear_grads`: TRL has transformers run them);
- the reward function (the user's, called through `call_reward_function`): neither shared model work nor
  llmtrain's overhead, booked apart;
- llmtrain's own: everything else: the sampling loop, the fused head's log-softmax, entropy and PPO loss with its
  gradient (`FusedHeadMixin.forward` and the chunked head's backward, less the matmuls; it runs inside the model's
  forward, so it is taken out of the shared share), advantages, bookkeeping.

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


def total(stats: dict, file_end: str, names: tuple[str, ...]) -> float:
    """Σ cumulative seconds of the named functions of one file (siblings: none calls another)."""
    return sum(value[3] for (file, _, name), value in stats.items() if file.endswith(file_end) and name in names)


def split(prof: Path) -> dict:
    """The module docstring's accounting: shared + reward function + llmtrain's own = the training loop."""
    stats = pstats.Stats(str(prof)).stats
    loop, _ = cumulative(stats, lambda f, n: f.endswith("llmtrain/trainer.py") and n == "fit")
    iterations = cumulative(stats, lambda f, n: f.endswith("stages/ppo/stage.py") and n == "train_step")[1]
    # the outermost model call: every rollout, experience and update forward goes through *ForCausalLM.forward
    model, _ = cumulative(stats, lambda f, n: "transformers/models/" in f and n == "forward")
    backward, _ = cumulative(stats, lambda f, n: f.endswith("torch/autograd/graph.py") and n == "_engine_run_backward")
    optimizer, _ = cumulative(stats, lambda f, n: "torch/optim/" in f and n == "step")
    head = total(stats, "llmtrain/models/fused_head.py", ("forward",))  # inside the model's forward
    head_backward = total(stats, "llmtrain/models/chunked_head.py", ("backward",))  # inside autograd's backward
    matmuls = total(stats, "llmtrain/models/chunked_head.py", ("chunk_logits", "accumulate_linear_grads"))
    head_own = head + head_backward - matmuls  # the fused head's loss: llmtrain's code, not the model's
    reward, _ = cumulative(stats, lambda f, n: f.endswith("stages/ppo/rewards.py") and n == "call_reward_function")
    shared = model + backward + optimizer - head_own
    own = loop - shared - reward
    return {"iterations": iterations, "loop_s": loop, "model_forward_s": model - head + matmuls,
            "backward_s": backward - head_backward, "optimizer_s": optimizer, "fused_head_loss_s": head_own,
            "reward_function_s": reward, "own_s": own, "shared_share": shared / loop, "reward_share": reward / loop,
            "own_share": own / loop, "bound_if_own_code_took_no_time": loop / (shared + reward)}


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
    print(f"  shared (the model's work, as in TRL): {figures['shared_share']:.0%}")
    for key in ("model_forward_s", "backward_s", "optimizer_s"):
        print(f"  {key[:-2]:>16}: {figures[key]:6.2f} s  ({figures[key] / figures['loop_s']:.0%})")
    print(f"  reward function (the user's): {figures['reward_function_s']:6.2f} s  ({figures['reward_share']:.0%})")
    print(f"  llmtrain's own: {figures['own_s']:6.2f} s  ({figures['own_share']:.0%}), of which the fused head's "
          f"loss {figures['fused_head_loss_s']:.2f} s")
    print(f"the most a faster llmtrain could gain with the same model code: "
          f"{figures['bound_if_own_code_took_no_time']:.2f}x")


if __name__ == "__main__":
    main()
