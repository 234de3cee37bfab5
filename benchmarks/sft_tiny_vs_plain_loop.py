"""sft_tiny through llmtrain vs a plain hand-written PyTorch loop: same model, data, batch, optimizer.

Prints target tokens/s (response tokens only, the figure llmtrain logs) for each contender, median
over steps after a warm-up, contenders run alternately. Usage:
    python benchmarks/sft_tiny_vs_plain_loop.py [--steps 120] [--rounds 3]
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

import torch

REPO = Path(__file__).resolve().parent.parent
WARMUP = 10


def plain_loop(steps: int, batch_size: int = 32) -> float:
    """The loop a user writes by hand: tokenize, pad, forward, mean CE on response tokens, AdamW."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(REPO / "llmtrain" / "assets" / "tokenizer")
    rows = [json.loads(line) for line in open(REPO / "llmtrain" / "assets" / "data" / "reverse_train.jsonl")]
    samples = []
    for row in rows:
        prompt = [tokenizer.bos_token_id] + tokenizer(row["prompt"], add_special_tokens=False).input_ids
        response = tokenizer(row["response"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        samples.append((prompt + response, [-100] * len(prompt) + response))
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    rates = []
    for step in range(steps):
        start = time.perf_counter()
        batch = [samples[i] for i in order[step * batch_size:(step + 1) * batch_size]]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        targets = int((labels[:, 1:] != -100).sum())
        loss.item()
        rates.append(targets / (time.perf_counter() - start))
    return statistics.median(rates[WARMUP:])


def llmtrain_run(steps: int, *overrides: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "llmtrain", "recipe=sft_tiny", f"trainer.max_steps={steps}",
                        "trainer.eval_every_n_steps=0", "data.eval_files=[]", "trainer.save_every_n_steps=0",
                        "trainer.log_every_n_steps=0", f"output_dir={out}", *overrides],
                       check=True, capture_output=True,
                       env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
        records = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    return statistics.median(r["tokens_per_s"] for r in records[WARMUP:] if "tokens_per_s" in r)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = {"plain loop": [], "llmtrain": [], "llmtrain, chunked head": []}
    for _ in range(args.rounds):
        results["plain loop"].append(plain_loop(args.steps))
        results["llmtrain"].append(llmtrain_run(args.steps))  # model.fused_loss=auto: full logits at V 263
        results["llmtrain, chunked head"].append(llmtrain_run(args.steps, "model.fused_loss=chunked"))
    base = statistics.median(results["plain loop"])
    print(f"{'contender':<24} {'median target tok/s':>20} {'spread':>18} {'vs plain':>9}")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:<24} {median:>20,.0f} {min(values):>8,.0f}-{max(values):<9,.0f} {median / base:>8.2f}x")


if __name__ == "__main__":
    main()
