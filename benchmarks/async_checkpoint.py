"""What a saving step pays for its checkpoint: trainer.async_save=false (written in the step) against true (copied to
host memory in the step, written by a thread while the next steps train), on 2 CPU ranks (torchrun, gloo), FSDP2
and DDP, on a Llama big enough that the write takes about a second (default: h 768, 8 layers, ~57M parameters:
~0.7 GB of weights and Adam state per checkpoint).

    python benchmarks/async_checkpoint.py [--backends fsdp2 ddp] [--steps 8] [--save-every 2] [--hidden 768]
                                          [--layers 8] [--out benchmarks/results/async_checkpoint.json]

Each run is llmtrain's own entry (`llmtrain.run.run`) with two timers around what the trainer calls, nothing else
changed: `Trainer.save` (what the saving step pays: the trainer's `time_ckpt_s`, when the trainer reports it, is the
same interval) and `Checkpointer.finalize_pending` (the wait for the background write at the next save or the end of
fit, inside the former or at the end). Per saving step the slower rank counts (the step ends when both have). Printed:
the median save seconds per mode, the wait for the write, the checkpoint size, the median step time after a save
against the others (the background write shares the 2 cores with training), and the whole run's wall clock.
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


def worker(spec_file: str) -> None:
    """Under torchrun: one llmtrain run with the two timers; each rank writes SPEC.rank<r>.json."""
    spec = json.loads(Path(spec_file).read_text())
    sys.path.insert(0, str(REPO))
    from llmtrain.checkpoint import Checkpointer
    from llmtrain.compose import compose_config
    from llmtrain.run import run
    from llmtrain.trainer import Trainer

    timings = {"save": [], "finalize": []}

    def timed(cls, name: str, key: str) -> None:
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                step = getattr(self, "step", None)
                timings[key].append({"step": step, "seconds": time.perf_counter() - start})

        setattr(cls, name, wrapper)

    timed(Trainer, "save", "save")
    timed(Checkpointer, "finalize_pending", "finalize")
    start = time.perf_counter()
    run(compose_config(spec["args"]))
    timings["wall_s"] = time.perf_counter() - start
    Path(f"{spec_file}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(timings))


def launch(args: list[str], work: Path, name: str, timeout: int) -> dict:
    out = work / name
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({"args": [*args, f"output_dir={out}"]}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, "--worker", str(spec)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-4000:]}")
    ranks = [json.loads(Path(f"{spec}.rank{r}.json").read_text()) for r in (0, 1)]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in records if "loss" in r]
    step_dir = max((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return {"ranks": ranks, "steps": steps, "checkpoint_bytes": sum(f.stat().st_size for f in step_dir.rglob("*")
                                                                     if f.is_file())}


def summarise(result: dict, save_every: int) -> dict:
    """Per saving step the slower rank's seconds; medians over the saving steps. A save runs after its step's row,
    so the trainer's clock (time_<phase>_s) puts it in the next step's window: `window_after_save_s` is that
    whole window (the save, then a step that trains while the write goes on), `train_after_save_s` the window less
    time_ckpt_s (when the trainer reports it), `window_other_s` the windows without a save."""
    saves = [max(rank["save"][i]["seconds"] for rank in result["ranks"])
             for i in range(len(result["ranks"][0]["save"]))]
    waits = [max(rank["finalize"][i]["seconds"] for rank in result["ranks"])
             for i in range(len(result["ranks"][0]["finalize"]))]
    after = [r for r in result["steps"] if r["step"] % save_every == 1 and r["step"] > 1]
    others = [r["step_time_s"] for r in result["steps"] if r["step"] % save_every != 1 and r["step"] > 2]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {"save_s": saves, "save_median_s": statistics.median(saves), "finalize_s": waits,
            "window_after_save_s": median([r["step_time_s"] for r in after]),
            "train_after_save_s": median([r["step_time_s"] - r["time_ckpt_s"] for r in after if "time_ckpt_s" in r]),
            "window_other_s": median(others), "time_ckpt_s": [r.get("time_ckpt_s") for r in after],
            "wall_s": max(rank["wall_s"] for rank in result["ranks"]),
            "checkpoint_gb": result["checkpoint_bytes"] / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker")
    parser.add_argument("--backends", nargs="+", default=["fsdp2", "ddp"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/async_checkpoint.json"))
    opts = parser.parse_args()
    if opts.worker:
        return worker(opts.worker)
    model = ["recipe=sft_tiny", f"model.from_config.hidden_size={opts.hidden}",
             f"model.from_config.intermediate_size={opts.hidden * 8 // 3 // 64 * 64}",
             f"model.from_config.num_hidden_layers={opts.layers}", "model.from_config.num_attention_heads=12",
             "model.from_config.num_key_value_heads=4", "trainer.micro_batch_size=2", "data.max_seq_len=64",
             f"trainer.max_steps={opts.steps}", f"trainer.save_every_n_steps={opts.save_every}",
             "trainer.keep_last_k=1", "trainer.eval_every_n_steps=0", "trainer.log_every_n_steps=0",
             "data.eval_files=[]", "data.eval_fraction=0"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="async_ckpt_") as tmp:
        for backend in opts.backends:
            for mode in ("false", "true"):
                name = f"{backend}_async_{mode}"
                raw = launch([*model, f"backend={backend}", f"trainer.async_save={mode}"], Path(tmp), name,
                             opts.timeout)
                results[name] = summarise(raw, opts.save_every)
                print(f"{name}: {json.dumps(results[name])}", flush=True)
    table = report(results, opts)
    print("\n" + table)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(results, indent=1) + "\n")
    Path(opts.out).with_suffix(".md").write_text(table)


def report(results: dict, opts) -> str:
    """The Markdown table (docs/guide/checkpoints.md includes it): per run the slower rank of each saving step."""
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [f"Llama h {opts.hidden}, {opts.layers} layers, fp32, {opts.steps} steps saved every {opts.save_every}, "
             f"2 ranks; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end. `save`: what the "
             "saving step pays (`Trainer.save`, the trainer's `time_ckpt_s`), median over the saves, slower rank; "
             "`wait`: the longest wait for a background write (at the next save or the end of fit); `window`: the "
             "step window holding a save (the save, then a step that trains while the write goes on), its training "
             "part (window less the save), and a window without a save.", "",
             "| run | checkpoint GB | save s | wait s | window with a save s | its training s | window without s "
             "| run s |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['checkpoint_gb']:.2f} | {r['save_median_s']:.2f} | "
                     f"{max(r['finalize_s'], default=0.0):.2f} | {seconds(r['window_after_save_s'])} | "
                     f"{seconds(r['train_after_save_s'])} | {seconds(r['window_other_s'])} | {r['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
