"""--suite vocab: the logits wall. Peak memory and step time of the LM head and loss, fused (model.fused_loss=auto)
against full logits (off), for SFT, DPO and GRPO with the Llama 3 (128,256) and Qwen (151,936) vocabularies (issue 20).

    python benchmarks/vocab.py [--rounds 3] [--vocab 128256 151936] [--only sft dpo grpo] [--large]

A tiny Llama (h=256, 2 layers, untied head, fp32, CPU) runs each stage's own training forward and backward (the code
`python -m llmtrain` runs: stages/head.py) in a fresh process per (stage, vocabulary, mode, round); no optimizer step,
which the head does not change. Per run: the peak RSS above the process's RSS before the first forward, and the
median step time and CPU time over the timed steps. `backbone` runs the model without its head at SFT's shape: its
peak (activations, backbone gradients) is subtracted to give the head and loss's own memory. `sft-recompute` is the
SFT loss through the per-token path (each chunk's logits recomputed in backward) instead of the token loss with its
gradient computed in forward: the two strategies side by side. `grpo` is the update's per-token loss (advantage-
weighted log p, entropy bonus), as stages/ppo computes it; `dpo` the per-token log-probs of 2 pairs of 1,024.
`--large` adds SFT at s=4096 × micro 8, where full logits do not fit in 24 GiB (16.8 GB per fp32 copy) and the fused
head does. Results: results/vocab.json and results/vocab.md.
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
    "sft-large": (8, 4096, 0), "backbone": (4, 1024, 0)}


def worker(stage: str, vocab: int, fused: bool, steps: int) -> dict:
    import torch

    from llmtrain.data.collate import collate
    from llmtrain.losses.lm import IGNORE_INDEX
    from llmtrain.models.fused_head import HeadQuery, install, negative_log_likelihood, shifted_targets
    from llmtrain.stages.head import action_answer, flat_actions, lm_forward, target_logps

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
        elif stage == "backbone":  # what every mode shares: the model without its head (the baseline of head memory)
            loss = model.model(input_ids=ids).last_hidden_state.float().pow(2).mean()
        else:  # the PPO/GRPO update: a per-token loss (advantage-weighted log p, entropy bonus), as stages/ppo does
            advantages = flat_actions(torch.randn(rows, actions, generator=torch.Generator().manual_seed(0)))

            def token_loss(rows_, logp, entropy):
                return -(logp * advantages[rows_]).sum() - 0.01 * entropy.sum()

            answer = action_answer(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids, actions,
                                   temperature=0.9, entropy=True, token_loss=token_loss)
            loss = answer.loss_sum
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


def medians(results: list[dict], stage: str, vocab: int, fused: bool) -> dict | None:
    good = [r for r in results if (r["stage"], r["vocab"], r["fused"]) == (stage, vocab, fused) and "failed" not in r]
    return {k: statistics.median(r[k] for r in good) for k in ("peak_above_base", "step_s", "cpu_s")} if good else None


def table(results: list[dict]) -> str:
    """Head + loss memory: a mode's peak above base minus the backbone's (the model without its head, same shape)."""
    lines = ["| stage | V | tokens | head+loss GB: off | fused | off / fused | step s: off | fused | "
             "CPU-s fused / off |", "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["stage"], r["vocab"]) for r in results if r["stage"] != "backbone"},
                  key=lambda k: (list(SHAPES).index(k[0]), k[1]))
    for stage, vocab in keys:
        off, on = medians(results, stage, vocab, False), medians(results, stage, vocab, True)
        base = medians(results, "backbone", vocab, False)
        base_peak = base["peak_above_base"] if base and SHAPES[stage][:2] == SHAPES["backbone"][:2] else None

        def head(c):
            if c is None:
                return "did not fit"
            return "-" if base_peak is None else f"{(c['peak_above_base'] - base_peak) / 1e9:.2f}"
        ratio = (f"{(off['peak_above_base'] - base_peak) / (on['peak_above_base'] - base_peak):.1f}×"
                 if off and on and base_peak is not None else "-")
        step = " | ".join("-" if c is None else f"{c['step_s']:.2f}" for c in (off, on))
        cpu = f"{on['cpu_s'] / off['cpu_s']:.2f}" if off and on else "-"
        tokens = SHAPES[stage][0] * SHAPES[stage][1]
        lines.append(f"| {stage} | {vocab:,} | {tokens:,} | {head(off)} | {head(on)} | {ratio} | {step} | {cpu} |")
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
    parser.add_argument("--only", nargs="+", default=["backbone", "sft", "sft-recompute", "dpo", "grpo"])
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
                    if stage == "backbone" and fused:
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
