"""An independent reference inside the suite: a plain PyTorch loop with no llmtrain code in it matches llmtrain's
losses, grad norms and lrs to 1e-6 relative for 10 steps, on unpacked and on packed rows.

llmtrain trains the saved tiny model (`recipe=sft_tiny`, one process, fp32, accumulation 2, clipping at 1.0, a
warm-up then cosine schedule, dropout 0). It runs in a subprocess this module starts (the worker
tests/e2e/workers/capture_batches.py), which records from outside llmtrain every micro-batch the trainer fetched,
at the trainer's `prepare_batch` seam: the tensors the loader produced (input_ids, labels, the padding mask; packed
rows also position_ids and each row's sample lengths), saved with torch.save. `reference_run` then trains the same
saved model on them with transformers and torch only: the model loaded with `attn_implementation="sdpa"`
(llmtrain's default on CPU is its own per-sample causal sdpa), the padding mask for unpacked rows, for packed rows
a block-diagonal causal float mask and position ids built here from the sample lengths, the token-summed
cross-entropy divided by the step's target tokens, AdamW, `clip_grad_norm_`, the schedule written out by hand.

weight_decay is 0.0 (the sft_tiny recipe's value): AdamW's groups (no decay on biases and norm scales) are then
moot, and the reference uses one group.

The training file holds 24 samples and every step is one global batch of all of them (unpacked: 12 rows × 2
micro-batches; packed: the 10 rows best-fit packing makes of them, 5 per micro-batch), so both runs see the same
samples at every step: llmtrain's packed run (micro-batches of 5 packed rows, with padding) also matches its
unpacked run to 1e-5 (the README's packed = unpacked claim, end to end through the trainer).
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import PYTHON, REPO, assert_ok, cli_env, read_metrics

pytestmark = pytest.mark.e2e

STEPS, ACCUM, LR, WARMUP, MIN_LR_RATIO, MAX_NORM, BETAS, EPS = 10, 2, 1e-3, 3, 0.1, 1.0, (0.9, 0.95), 1e-8
SAMPLES, UNPACKED_MICRO, PACKED_ROWS = 24, 12, 10
IGNORE = -100


def llmtrain_args(model_dir: Path, train_file: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["recipe=sft_tiny", f"model.name_or_path={model_dir}", "model.from_config=null", "model.tokenizer=null",
            f"output_dir={out_dir}", f"data.train_files=[{train_file}]", "data.eval_files=[]",
            "trainer.eval_every_n_steps=0", "trainer.log_every_n_steps=0", f"trainer.max_steps={STEPS}",
            f"trainer.grad_accum_steps={ACCUM}", "trainer.save_every_n_steps=0", "precision=fp32",
            "model.dropout=0.0", f"optim.lr={LR}", f"optim.warmup_steps={WARMUP}", "optim.schedule=cosine",
            f"optim.min_lr_ratio={MIN_LR_RATIO}", f"optim.max_grad_norm={MAX_NORM}", "optim.weight_decay=0.0",
            f"optim.betas=[{BETAS[0]},{BETAS[1]}]", f"optim.eps={EPS}", *extra]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[list[dict], list[dict]]]:
    """mode -> (llmtrain's metrics per step, the micro-batches it trained on), for unpacked and packed rows."""
    root = tmp_path_factory.mktemp("reference_loop")
    train_file = root / "train.jsonl"
    train_file.write_text("".join((REPO / "llmtrain/assets/data/reverse_train.jsonl").read_text()
                                  .splitlines(True)[:SAMPLES]))
    out = {}
    for mode, extra in [("unpacked", [f"trainer.micro_batch_size={UNPACKED_MICRO}"]),
                        ("packed", ["data.packing=true", f"trainer.micro_batch_size={PACKED_ROWS // ACCUM}"])]:
        run_dir, captured = root / mode, root / f"{mode}_batches.pt"
        cmd = [PYTHON, "-m", "tests.e2e.workers.capture_batches", "capture", str(captured),
               *llmtrain_args(tiny_model_dir, train_file, run_dir, *extra)]
        assert_ok(subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600, cwd=REPO))
        out[mode] = (read_metrics(run_dir)[0], torch.load(captured, weights_only=True))
    return out


@pytest.mark.parametrize("mode", ["unpacked", "packed"])
def test_plain_pytorch_loop_matches_llmtrain(trained, tiny_model_dir, mode):
    ours, batches = trained[mode]
    assert len(batches) == STEPS * ACCUM  # every micro-batch the trainer fetched, and nothing else
    if mode == "packed":
        assert all(b["seq_lens"] is not None and len(b["seq_lens"]) == PACKED_ROWS // ACCUM for b in batches)
        assert any(len(lens) > 1 for b in batches for lens in b["seq_lens"])  # rows really hold several samples
        assert sum(len(lens) for b in batches[:ACCUM] for lens in b["seq_lens"]) == SAMPLES
    reference = reference_run(tiny_model_dir, batches)
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    for a, b in zip(ours, reference):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]), f"{mode} step {a['step']} {key}: {a[key]} vs {b[key]}"
    assert any(r["grad_norm"] > MAX_NORM for r in reference)  # clipping really acts
    assert reference[-1]["loss"] < reference[0]["loss"]


def test_packed_rows_train_as_unpacked(trained):
    """Micro-batches of 5 packed rows (padded to the longest) vs the same samples unpacked: every step's
    samples are the same (one global batch is the whole file), so loss and grad norm agree to 1e-5."""
    unpacked, packed = trained["unpacked"][0], trained["packed"][0]
    assert [r["tokens"] for r in packed] == [r["tokens"] for r in unpacked]
    for a, b in zip(packed, unpacked):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), f"step {a['step']} {key}: {a[key]} vs {b[key]}"


# ---- the reference: transformers and torch only, no llmtrain ---------------------------------------------------

def lr_at(step: int) -> float:
    """The lr of 0-based optimizer step `step`: linear warm-up over WARMUP steps, then cosine from LR down to
    MIN_LR_RATIO·LR at the last step."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def packed_inputs(batch: dict) -> dict:
    """Position ids restarting per sample and a (B, 1, T, T) float mask: a token sees the tokens of its own
    sample up to itself (0), nothing else (the most negative float); each padding position sees only itself."""
    rows, width = len(batch["seq_lens"]), batch["input_ids"].shape[1]
    mask = torch.full((rows, 1, width, width), torch.finfo(torch.float32).min)
    positions = torch.zeros(rows, width, dtype=torch.long)
    for b, lengths in enumerate(batch["seq_lens"]):
        start = 0
        for length in lengths:
            end = start + length
            mask[b, 0, start:end, start:end] = torch.triu(
                torch.full((length, length), torch.finfo(torch.float32).min), 1)
            positions[b, start:end] = torch.arange(length)
            start = end
        for pad in range(start, width):
            mask[b, 0, pad, pad] = 0.0
    return {"attention_mask": mask, "position_ids": positions}


def reference_run(model_dir: Path, batches: list[dict]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    records = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        micro_batches = batches[step * ACCUM:(step + 1) * ACCUM]
        targets = [b["labels"][:, 1:].clone() for b in micro_batches]  # (B, T-1): token t+1 is predicted at t
        for b, target in zip(micro_batches, targets):
            if b["seq_lens"] is not None:  # a packed sample's first token is not predicted from the previous one
                for row, lengths in enumerate(b["seq_lens"]):
                    starts = torch.tensor(lengths).cumsum(0)[:-1]  # where samples 2.. begin
                    target[row, starts - 1] = IGNORE
        count = sum(int((target != IGNORE).sum()) for target in targets)
        loss_total = 0.0
        for b, target in zip(micro_batches, targets):
            if b["seq_lens"] is None:
                inputs = {"attention_mask": b["attention_mask"]}
            else:
                inputs = packed_inputs(b)
                assert torch.equal(inputs["position_ids"], b["position_ids"])  # llmtrain's positions are these
            logits = model(input_ids=b["input_ids"], **inputs).logits  # (B, T, V)
            loss_sum = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         target.reshape(-1), ignore_index=IGNORE, reduction="sum")
            (loss_sum / count).backward()
            loss_total += loss_sum.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        records.append({"loss": loss_total / count, "grad_norm": grad_norm.item(), "lr": lr_at(step), "tokens": count})
    return records
