"""Activations per rank under ring context parallelism (backend.cp) at a long sequence, measured against the planner.

One training step of recipe=pretrain_tiny on FSDP2 over 4 CPU ranks (gloo, fp32), rows of `--seq` packed tokens,
one row per rank and micro-batch, at cp 1, 2 and 4 (dp 4, 2, 1): each rank holds seq/cp tokens of its row. The run
logs what it measured (metrics/live.py: the bytes the forward saved for backward at the peak micro-batch, rank 0)
beside the planner's figure at that rank's shape (`memory_r0_plan_activations`). The claim: activations ∝ 1/cp, and
the measured figure within 5 % of the plan.

    python benchmarks/cp_activations.py --seq 8192            # ~2 min on 2 cores; writes results/cp_activations.*
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MIB = 2 ** 20


def run(cp: int, seq: int, out: Path, world: int = 4) -> dict:
    """rank 0's first-step record of a cp run."""
    args = ["recipe=pretrain_tiny", "backend=fsdp2", f"backend.cp={cp}", f"data.max_seq_len={seq}",
            f"model.from_config.max_position_embeddings={seq}", "trainer.micro_batch_size=1",
            "trainer.grad_accum_steps=1", "trainer.max_steps=1", "trainer.eval_every_n_steps=0",
            "trainer.save_every_n_steps=0", "model.fused_loss=off", "data.eval_files=[]", f"output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                           "-m", "llmtrain", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"cp {cp} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--no-write", action="store_true", help="print only (a partial run keeps the results)")
    a = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (1, 2, 4):
            record = run(cp, a.seq, Path(tmp) / f"cp{cp}")
            measured, planned = record["memory_r0_activations"], record["memory_r0_plan_activations"]
            rows.append({"cp": cp, "tokens_per_rank": record["memory_r0_activation_seq"], "measured_bytes": measured,
                         "plan_bytes": planned, "measured_over_plan": measured / planned})
    base = rows[0]["measured_bytes"]
    lines = [f"# Activations per rank under ring context parallelism (seq {a.seq}, FSDP2, 4 CPU ranks, fp32)", "",
             "| cp | tokens per rank | measured MiB | plan MiB | measured / plan | measured × cp / cp 1's |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cp']} | {r['tokens_per_rank']} | {r['measured_bytes'] / MIB:.1f} | "
                     f"{r['plan_bytes'] / MIB:.1f} | {r['measured_over_plan']:.3f} | "
                     f"{r['measured_bytes'] * r['cp'] / base:.3f} |")
    text = "\n".join(lines)
    print(text)
    if not a.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "cp_activations.json").write_text(json.dumps({"seq": a.seq, "rows": rows}, indent=1))
        (RESULTS / "cp_activations.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
