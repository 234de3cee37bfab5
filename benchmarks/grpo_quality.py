"""Quality at equal budget: llmtrain's grpo_tiny and rloo_tiny against TRL's GRPOTrainer, three seeds each.

    python benchmarks/grpo_quality.py [--seeds 1 2 3] [--iterations 80] [--out benchmarks/results/grpo_quality]

Every contender starts from the same sft_tiny base (`${base:sft_tiny}`), trains on llmtrain/assets/data/
reverse_train.jsonl with grpo_tiny's settings — 32 prompts × 4 samples per iteration (temperature 1, at most 16 new
tokens), group-normalised advantages, clipped surrogate ε 0.2, k3 KL to the reference as a loss term with β 0.01,
token mean over the global batch (TRL loss_type="dapo"), 2 passes over each rollout in mini-batches of 32 (TRL
num_iterations=2, per_device_train_batch_size=32, steps_per_generation=4), constant lr 3e-5, AdamW, clipping at
1.0, the reversal reward with −0.5 for a response without EOS — for the same number of iterations, then ONE judge
scores every model: greedy decoding (HF generate, KV cache, 16 new tokens, stop at EOS) of the 256 held-out
prompts of reverse_eval.jsonl, exact match of the reversal. rloo_tiny is the same with RLOO advantages (its recipe:
β 0.01 k1 in the reward, whitened). Figures: each seed's exact match, the mean and the spread (min–max) per
contender, and the base's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

DATA = C.REPO / "llmtrain" / "assets" / "data"
PROMPTS, GROUP, MAX_NEW_TOKENS, MINI_BATCH, EPOCHS = 32, 4, 16, 32, 2
KL_COEF, CLIP_EPS, LR, MISSING_EOS_PENALTY = 0.01, 0.2, 3e-5, -0.5


def sft_tiny_base() -> str:
    from llmtrain.bases import resolve_base
    from llmtrain.compose import compose_config

    return resolve_base("sft_tiny", compose_config)


# ---- the judge: one greedy exact-match harness for every model ---------------------------------------------------

def exact_match(model_dir: str, batch_size: int = 64) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from llmtrain.data.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = [json.loads(line) for line in (DATA / "reverse_eval.jsonl").read_text().splitlines()]
    config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, use_cache=True,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        encoded = [encode_prompt(r["prompt"], tokenizer) for r in chunk]
        width = max(map(len, encoded))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e)) + e for e in encoded])
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
        for row, tokens in zip(chunk, out.tolist()):
            if tokenizer.eos_token_id in tokens:
                tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
            correct += tokenizer.decode(tokens, skip_special_tokens=True).strip() == row["response"].strip()
    return correct / len(rows)


# ---- the contenders -------------------------------------------------------------------------------------------

def run_llmtrain(recipe: str, seed: int, iterations: int, out: Path) -> str:
    args = [f"recipe={recipe}", f"trainer.seed={seed}", f"trainer.max_steps={iterations}", f"output_dir={out}",
            "trainer.eval_every_n_steps=0", "data.eval_files=[]", "trainer.save_every_n_steps=0",
            "trainer.log_every_n_steps=0", "precision=fp32"]
    subprocess.run([sys.executable, "-m", "llmtrain", *args], check=True, cwd=C.REPO, capture_output=True)
    return str(out / "hf")


def run_trl(base: str, seed: int, iterations: int, out: Path) -> str:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from llmtrain.rewards.reversal import score

    tokenizer = AutoTokenizer.from_pretrained(base)
    eos = tokenizer.eos_token_id
    rows = [json.loads(line) for line in (DATA / "reverse_train.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": "<s>" + r["prompt"], "response": r["response"]} for r in rows])

    def reversal_reward(prompts, completions, completion_ids, response=None, **_):
        scores = score(prompts, completions, response=response)
        return [s + (0.0 if eos in ids else MISSING_EOS_PENALTY) for s, ids in zip(scores, completion_ids)]

    steps_per_generation = PROMPTS * GROUP // MINI_BATCH
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=MINI_BATCH, gradient_accumulation_steps=1,
        steps_per_generation=steps_per_generation, num_generations=GROUP, max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0, top_p=1.0, top_k=0, beta=KL_COEF, epsilon=CLIP_EPS, num_iterations=EPOCHS,
        loss_type="dapo", scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=iterations * steps_per_generation * EPOCHS,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False, seed=seed, logging_steps=50,
        disable_dropout=True, log_completions=False, dataloader_num_workers=0, generation_kwargs={"use_cache": True})
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    trainer = GRPOTrainer(model=model, reward_funcs=reversal_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(out / "hf"))
    tokenizer.save_pretrained(str(out / "hf"))
    return str(out / "hf")


CONTENDERS = {"llmtrain grpo_tiny": lambda base, seed, n, out: run_llmtrain("grpo_tiny", seed, n, out),
              "TRL GRPOTrainer": run_trl,
              "llmtrain rloo_tiny": lambda base, seed, n, out: run_llmtrain("rloo_tiny", seed, n, out)}


def one(name: str, seed: int, iterations: int, work: Path) -> dict:
    """Train contender `name` with `seed` in this process's child (TRL: here), then judge it."""
    out = work / f"{name.replace(' ', '_')}_{seed}"
    start = time.perf_counter()
    model_dir = CONTENDERS[name](sft_tiny_base(), seed, iterations, out)
    trained = time.perf_counter() - start
    return {"contender": name, "seed": seed, "exact_match": exact_match(model_dir), "train_s": trained}


def table(result: dict) -> str:
    lines = [f"# GRPO quality at equal budget ({result['iterations']} iterations, seeds {result['seeds']})", "",
             f"Greedy exact match on the 256 held-out reversals; the sft_tiny base: {result['base']:.3f}.", "",
             "| contender | per seed | mean | spread (min–max) |", "|---|---|---|---|"]
    for name, runs in result["contenders"].items():
        scores = [r["exact_match"] for r in runs]
        lines.append(f"| {name} | {', '.join(f'{s:.3f}' for s in scores)} | {statistics.fmean(scores):.3f} | "
                     f"{min(scores):.3f}–{max(scores):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    parser.add_argument("--work", default="/tmp/grpo_quality")
    parser.add_argument("--out", default=str(C.REPO / "benchmarks" / "results" / "grpo_quality"))
    parser.add_argument("--one", nargs=2, metavar=("CONTENDER", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    C.set_threads()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.one:  # a child: one contender, one seed, its record on stdout's last line
        print(json.dumps(one(args.one[0], int(args.one[1]), args.iterations, work)))
        return
    result = {"iterations": args.iterations, "seeds": args.seeds, "base": exact_match(sft_tiny_base()),
              "contenders": {}}
    for name in args.contenders:
        for seed in args.seeds:  # every run in a fresh process: nothing of one leaks into the next
            done = subprocess.run([sys.executable, __file__, "--one", name, str(seed), "--iterations",
                                   str(args.iterations), "--work", str(work)], check=True, capture_output=True,
                                  text=True, cwd=C.REPO)
            record = json.loads(done.stdout.strip().splitlines()[-1])
            result["contenders"].setdefault(name, []).append(record)
            print(record, flush=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    Path(args.out + ".md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
