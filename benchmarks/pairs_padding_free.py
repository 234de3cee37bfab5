"""Prototype estimate (not llmtrain code): what padding-free pairs would save in the reward-model and DPO steps.

    python benchmarks/pairs_padding_free.py [--steps 10] [--reps 3]

llmtrain's pair stages run each micro-batch of P pairs as ONE forward of 2P right-padded rows (chosen, then
rejected), so every row is as wide as the longest of the 2P sequences. On the preference suite's data that
is 2,071 real tokens in 5,275 per step (39 %). This script times, in one process and alternately, the model
work of a step both ways on the suite's first `--steps` batches (same model files, same token ids as
llmtrain builds them: [bos] prompt response [eos]):
- padded: (2P, T) rows, causal attention without a mask (llmtrain's `sdpa_segments` on unpacked rows);
- padding-free: the 2P sequences back to back in one row (1, Σ len), position ids restarting at each
  sequence, llmtrain's own `sdpa_segments` attention given the sequence lengths (causal per sequence).
Reward model: forward + backward of the scores pooled at each EOS. DPO: policy forward + backward and the
frozen reference forward (no grad) of the per-sequence response log-probs. It checks that both layouts give
the same scores / log-probs (max |Δ|) and reports CPU seconds per step (process time: on a shared machine
it moves much less with the neighbours than wall time) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import preference as P  # noqa: E402


def sequences(pairs: list[dict], step: int) -> tuple[list[list[int]], list[list[int]]]:
    """A step's 2P sequences (chosen rows, then rejected rows) and their labels, as llmtrain encodes them."""
    tok = C.tokenizer()
    batch = pairs[step * P.PAIRS_PER_STEP:(step + 1) * P.PAIRS_PER_STEP]
    ids, labels = [], []
    for side in ("chosen", "rejected"):
        for p in batch:
            prompt = [tok.bos_token_id] + C._bytes_to_ids(p["prompt"])
            response = C._bytes_to_ids(p[side]) + [tok.eos_token_id]
            ids.append(prompt + response)
            labels.append([C.IGNORE_INDEX] * len(prompt) + response)
    return ids, labels


def padded(ids, labels, pad_id: int) -> dict:
    import torch
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), pad_id)  # (2P, T)
    lab = torch.full((len(ids), width), C.IGNORE_INDEX)  # (2P, T)
    for i, (x, y) in enumerate(zip(ids, labels)):
        input_ids[i, :len(x)], lab[i, :len(y)] = torch.tensor(x), torch.tensor(y)
    lengths = torch.tensor([len(x) for x in ids])
    return {"inputs": {"input_ids": input_ids}, "labels": lab, "last": lengths - 1, "rows": torch.arange(len(ids)),
            "segments": None}


def flat(ids, labels) -> dict:
    import torch
    lengths = [len(x) for x in ids]
    input_ids = torch.tensor([t for x in ids for t in x])[None]  # (1, S)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, S)
    ends = torch.tensor(lengths).cumsum(0)
    return {"inputs": {"input_ids": input_ids, "position_ids": position_ids, "segment_lengths": (tuple(lengths),)},
            "labels": torch.tensor([t for y in labels for t in y])[None], "last": ends - 1,
            "rows": torch.zeros(len(ids), dtype=torch.long), "segments": lengths}


def scores(model, batch):
    """(2P,) rewards pooled at each sequence's EOS, from the per-token scores."""
    from llmtrain.models.heads import captured_token_scores
    with captured_token_scores(model) as captured:
        model(**batch["inputs"])
    return captured[-1][batch["rows"], batch["last"]]


def logps(model, batch):
    """(2P,) summed response log-probs per sequence."""
    import torch
    import torch.nn.functional as F
    logits = model(**batch["inputs"]).logits  # (B, T, V)
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=C.IGNORE_INDEX)  # (B, T): no target crosses a sequence
    token = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=C.IGNORE_INDEX,
                             reduction="none").view_as(targets)
    if batch["segments"] is None:
        return token.sum(-1)
    return torch.stack([part.sum() for part in token[0].split(batch["segments"])])


def rm_step(model, batch):
    import torch.nn.functional as F
    r = scores(model, batch)
    half = r.shape[0] // 2
    (-F.logsigmoid(r[:half] - r[half:])).sum().backward()
    return r.detach()


def dpo_step(models, batch):
    import torch
    import torch.nn.functional as F
    policy, reference = models
    pi = logps(policy, batch)
    with torch.no_grad():
        ref = logps(reference, batch)
    x = pi - ref
    half = x.shape[0] // 2
    (-F.logsigmoid(P.DPO_BETA * (x[:half] - x[half:]))).sum().backward()
    return pi.detach()


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from llmtrain.models.attention import SEGMENT_ATTENTION, register_segment_attention

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    C.set_threads()
    register_segment_attention()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        C.save_model(work / "model")
        pairs = P.generate_pairs()
        P.save_reward_model(work)
        load = dict(dtype=torch.float32, attn_implementation=SEGMENT_ATTENTION)
        rm = AutoModelForSequenceClassification.from_pretrained(work / "reward_model", **load)
        policy = AutoModelForCausalLM.from_pretrained(work / "model", **load)
        reference = AutoModelForCausalLM.from_pretrained(work / "model", **load).requires_grad_(False)
    pad_id = C.tokenizer().pad_token_id
    steps = [sequences(pairs, s) for s in range(args.steps)]
    layouts = {"padded": [padded(i, y, pad_id) for i, y in steps], "padding-free": [flat(i, y) for i, y in steps]}
    report = {}
    for name, step_fn, model in (("reward model", rm_step, rm), ("DPO", dpo_step, (policy, reference))):
        for m in (model if isinstance(model, tuple) else (model,)):
            m.train()
        values = {k: [step_fn(model, b) for b in batches] for k, batches in layouts.items()}  # warm-up + check
        diff = max((a - b).abs().max().item() for a, b in zip(values["padded"], values["padding-free"]))
        cpu = {k: [] for k in layouts}
        for _ in range(args.reps):  # alternate the layouts: the neighbours' load hits both alike
            for k, batches in layouts.items():
                start = time.process_time()
                for b in batches:
                    step_fn(model, b)
                    for m in (model if isinstance(model, tuple) else (model,)):
                        m.zero_grad(set_to_none=True)
                cpu[k].append((time.process_time() - start) / len(batches))
        med = {k: statistics.median(v) for k, v in cpu.items()}
        report[name] = med
        print(f"{name}: CPU-s per step padded {med['padded']:.3f}, padding-free {med['padding-free']:.3f} -> "
              f"{med['padded'] / med['padding-free']:.2f}x; max |diff| {diff:.1e}  (rounds: "
              + ", ".join(f"{k} " + "/".join(f"{x:.3f}" for x in v) for k, v in cpu.items()) + ")", flush=True)
    real = sum(len(x) for i, _ in steps for x in i) / len(steps)
    wide = sum(len(i) * max(map(len, i)) for i, _ in steps) / len(steps)
    print(f"tokens per step: {real:,.0f} real, {wide:,.0f} padded ({real / wide:.0%})")


if __name__ == "__main__":
    main()
