"""--suite vocab: the logits wall. Peak memory and step time of the LM head and loss, fused (model.fused_loss=auto)
against full logits (off), for SFT, DPO and GRPO with the Llama 3 (128,256) and Qwen (151,936) vocabularies (issue 20).

    python benchmarks/vocab.py [--rounds 3] [--vocab 128256 151936] [--only sft dpo grpo] [--large]

A tiny Llama (h=256, 2 layers, untied head, fp32, CPU) runs each stage's own training forward and backward (the code
`python -m llmtrain` runs: stages/head.py) in a fresh process per (stage, vocabulary, mode, round); no optimizer step,
which the head does not change. Per run: the peak RSS above the process's RSS before the first forward (the head and
loss plus the model's activations and gradients, which are the same for both modes; the figure the model states do
not blur), and the median step time and CPU time over the timed steps. `sft-recompute` is the SFT loss through the
per-token path (each chunk's logits recomputed in backward) instead of the summed loss's gradient computed in forward:
the two strategies, measured side by side. `--large` adds SFT at s=4096 × micro 8, where full logits do not fit in
24 GiB (16.8 GB per fp32 copy) and the fused head does. Results: results/vocab.json and results/vocab.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {  # stage: (rows, sequence length, response tokens)
    "sft": (4, 1024, 0), "sft-recompute": (4, 1024, 0), "dpo": (4, 1024, 0), "grpo": (8, 320, 256),
    "sft-large": (8, 4096, 0)}


def worker(stage: str, vocab: int, fused: bool, steps: int) -> dict:
    import torch

    from llmtrain.data.collate import collate
    from llmtrain.losses.lm import IGNORE_INDEX
    from llmtrain.models.fused_head import HeadQuery, install, negative_log_likelihood, shifted_targets
    from llmtrain.stages.head import action_answer, lm_forward, target_logps

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    if fused:
        install(model)
    rows, seq, actions = SHAPES[stage]
    ids = torch.randint(0, vocab, (rows, seq))
    prompt = seq // 4 if stage.startswith(("sft", "dpo")) else seq - actions
    batch = collate([{"input_ids": r.tolist(), "labels": [IGNORE_INDEX] * prompt + r[prompt:].tolist()} for r in ids],
                    pad_token_id=0)

    def step():
        if stage in ("sft", "sft-large"):
            query = HeadQuery(shifted_targets(batch.labels), token_loss=negative_log_likelihood)
            answer, _, _ = lm_forward(model, batch, query)
            loss = answer.loss_sum
        elif stage in ("sft-recompute", "dpo"):
            loss = -target_logps(model, batch)[0].logps.sum()  # DPO's per-token path; the pair loss is O(pairs)
        else:
            answer = action_answer(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids, actions,
                                   temperature=0.9, entropy=True)
            loss = -(answer.logps * torch.randn_like(answer.logps)).sum() - 0.01 * answer.entropy.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()  # warm-up
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"stage": stage, "vocab": vocab, "fused": fused, "tokens": rows * seq, "peak_above_base": peak - base,
            "step_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def run(stage: str, vocab: int, fused: bool, steps: int) -> dict | None:
    command = [sys.executable, __file__, "--worker", stage, str(vocab), str(int(fused)), str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        print(f"{stage} V={vocab} fused={fused}: failed ({tail[0]})", flush=True)
        return {"stage": stage, "vocab": vocab, "fused": fused, "failed": tail[0]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| stage | V | tokens | off: peak GB | fused: peak GB | ratio | off: step s | fused: step s | "
             "CPU-s ratio (fused/off) |", "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["stage"], r["vocab"]) for r in results}, key=lambda k: (list(SHAPES).index(k[0]), k[1]))
    for stage, vocab in keys:
        mine = {f: [r for r in results if (r["stage"], r["vocab"], r["fused"]) == (stage, vocab, f)] for f in (0, 1)}
        cells = {}
        for f, runs in mine.items():
            good = [r for r in runs if "failed" not in r]
            cells[f] = ({k: statistics.median(r[k] for r in good) for k in ("peak_above_base", "step_s", "cpu_s")}
                        if good else None)
        off, on = cells[0], cells[1]
        tokens = SHAPES[stage][0] * SHAPES[stage][1]

        def fmt(c, k, scale=1.0):
            return "did not fit" if c is None else f"{c[k] / scale:.2f}"
        ratio = f"{off['peak_above_base'] / on['peak_above_base']:.1f}×" if off and on else "-"
        cpu = f"{on['cpu_s'] / off['cpu_s']:.2f}" if off and on else "-"
        peaks = f"{fmt(off, 'peak_above_base', 1e9)} | {fmt(on, 'peak_above_base', 1e9)}"
        lines.append(f"| {stage} | {vocab:,} | {tokens:,} | {peaks} | {ratio} | {fmt(off, 'step_s')} | "
                     f"{fmt(on, 'step_s')} | {cpu} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        stage, vocab, fused, steps = sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])), int(sys.argv[5])
        print(json.dumps(worker(stage, vocab, fused, steps)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--vocab", type=int, nargs="+", default=[128_256, 151_936])
    parser.add_argument("--only", nargs="+", default=["sft", "sft-recompute", "dpo", "grpo"])
    parser.add_argument("--large", action="store_true")
    args = parser.parse_args()
    stages = args.only + (["sft-large"] if args.large else [])
    results = []
    for round_ in range(args.rounds):
        for stage in stages:
            for vocab in args.vocab:
                for fused in (False, True):
                    if stage == "sft-large" and (round_ > 0 or vocab != args.vocab[0]):
                        continue
                    if stage == "sft-large" and not fused:
                        results.append({"stage": stage, "vocab": vocab, "fused": False,
                                        "failed": "not run: 3 fp32 copies of 16.8 GB exceed the 24 GiB machine"})
                        continue
                    result = run(stage, vocab, fused, args.steps)
                    result["round"] = round_
                    results.append(result)
                    print(json.dumps(result), flush=True)
    out = HERE / "results"
    (out / "vocab.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "vocab.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
