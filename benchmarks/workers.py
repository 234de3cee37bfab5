"""The non-llmtrain contenders, each run in its own process by throughput.py:

    python benchmarks/workers.py {plain,hf,trl} --work DIR --steps N --warmup W --out result.json [--variant V]
        [--check]

plain: the loop a user writes by hand; hf: transformers `Trainer`; trl: `SFTTrainer` (variants: default,
default_nogc, padding_free, packing_bfd, packing_wrapped). Each records the wall time at the end of
every optimizer step and counts the target tokens of each step from the batches it actually trains on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def load_samples(work: Path) -> list[dict]:
    return json.loads((work / "samples.json").read_text())


# ---- plain loop -------------------------------------------------------------------------------------

def run_plain(args) -> dict:
    import torch

    tok = C.tokenizer()
    encoded = [C.encode(s, tok.bos_token_id, tok.eos_token_id) for s in load_samples(args.work)]
    device = torch.device(args.device)
    model = C.load_model(args.model or args.work / "model").to(device)
    model.train()
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.precision == "bf16" else \
        contextlib.nullcontext
    o = C.OPTIM
    optimizer = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=o["betas"], eps=o["eps"],
                                  weight_decay=o["weight_decay"])
    times, cpu, tokens, losses = [], [], [], []
    g = args.batch or C.GLOBAL_BATCH_SAMPLES
    for step in range(args.steps):
        first = (step * g) % (len(encoded) - g + 1)  # epochs roll over (the gpu suite runs more steps)
        batch = encoded[first:first + g]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tok.pad_token_id)  # (B, T)
        labels = torch.full((len(batch), width), C.IGNORE_INDEX)  # (B, T)
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, :len(lab)] = torch.tensor(lab)
            mask[i, :len(ids)] = 1
        input_ids, labels, mask = input_ids.to(device), labels.to(device), mask.to(device)
        with autocast():
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens.append(C.count_targets(labels))
        times.append(C.now())
        cpu.append(time.process_time())
    return dict(C.window_throughput(times, tokens, args.warmup, cpu), first_loss=losses[0], last_loss=losses[-1])


# ---- HF Trainer and TRL SFTTrainer --------------------------------------------------------------------

class Recorder:
    """Wraps a data collator (counts target tokens per collated batch, in order) and is a TrainerCallback
    (records the wall time at the end of each optimizer step). With grad accumulation 1, batch i feeds
    step i even when the dataloader prefetches a batch ahead."""

    def __init__(self, collator):
        self.collator, self.tokens, self.times, self.cpu, self.losses = collator, [], [], [], []

    def __call__(self, features):
        batch = self.collator(features)
        self.tokens.append(C.count_targets(batch["labels"]))
        return batch

    def callback(self):
        from transformers import TrainerCallback

        recorder = self

        class StepClock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                recorder.times.append(C.now())
                recorder.cpu.append(time.process_time())

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    recorder.losses.append(logs["loss"])

        return StepClock()


def common_training_args(out_dir: str, steps: int, batch: int) -> dict:
    o = C.OPTIM
    return dict(output_dir=out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=1, max_steps=steps,
                learning_rate=o["lr"], adam_beta1=o["betas"][0], adam_beta2=o["betas"][1], adam_epsilon=o["eps"],
                weight_decay=o["weight_decay"], max_grad_norm=o["max_grad_norm"], lr_scheduler_type="constant",
                warmup_steps=0, optim="adamw_torch", save_strategy="no", report_to="none", use_cpu=True,
                bf16=False, fp16=False, seed=C.INIT_SEED, dataloader_num_workers=0, logging_steps=1)


def sequential(trainer_class):
    """The same class, reading the dataset in order: unpacked contenders then train on the same batches."""
    from torch.utils.data import SequentialSampler

    class InOrder(trainer_class):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    InOrder.__name__ = trainer_class.__name__
    return InOrder


def run_hf(args) -> dict:
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tok = C.tokenizer()
    rows = [C.encode(s, tok.bos_token_id, tok.eos_token_id) for s in load_samples(args.work)]
    dataset = Dataset.from_dict({"input_ids": [ids for ids, _ in rows], "labels": [lab for _, lab in rows]})
    recorder = Recorder(DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=C.IGNORE_INDEX,
                                               return_tensors="pt"))
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(**common_training_args(out, args.steps, C.GLOBAL_BATCH_SAMPLES))
        trainer = sequential(Trainer)(model=C.load_model(args.work / "model"), args=training_args,
                                      train_dataset=dataset, data_collator=recorder,
                                      callbacks=[recorder.callback()])
        trainer.train()
    return finish(recorder, args)


TRL_VARIANTS = {
    # name: (SFTConfig fields beyond the common ones, packed rows?)
    "default": (dict(), False),  # TRL's defaults: gradient checkpointing on, no packing (bf16 forced off: fp32)
    "default_nogc": (dict(gradient_checkpointing=False), False),
    "padding_free": (dict(gradient_checkpointing=False, padding_free=True, max_length=None), False),
    "packing_bfd": (dict(gradient_checkpointing=False, packing=True, packing_strategy="bfd",
                         max_length=C.MAX_SEQ_LEN), True),
    "packing_wrapped": (dict(gradient_checkpointing=False, packing=True, packing_strategy="wrapped",
                             max_length=C.MAX_SEQ_LEN), True),
}


def run_trl(args) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    fields, packed = TRL_VARIANTS[args.variant]
    # "<s>" in the prompt text tokenises to bos: TRL's sequences are then llmtrain's, token for token
    # ([bos] prompt response [eos]; TRL appends the eos to the completion itself).
    dataset = Dataset.from_list([{"prompt": "<s>" + s["prompt"], "completion": s["response"]}
                                 for s in load_samples(args.work)])
    batch = C.GLOBAL_BATCH_ROWS_PACKED if packed else C.GLOBAL_BATCH_SAMPLES
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(**dict(common_training_args(out, args.steps, batch), **fields))
        trainer_class = SFTTrainer if packed else sequential(SFTTrainer)  # packed rows: TRL's own sampler
        trainer = trainer_class(model=C.load_model(args.work / "model"), args=config, train_dataset=dataset,
                                processing_class=C.tokenizer())
        recorder = Recorder(trainer.data_collator)
        trainer.data_collator = recorder
        trainer.add_callback(recorder.callback())
        trainer.train()
        result = finish(recorder, args)
        result["trl_config"] = {k: getattr(config, k) for k in ("gradient_checkpointing", "packing", "packing_strategy",
                                                               "padding_free", "max_length", "completion_only_loss")}
        result["trl_config"]["padding_free_effective"] = trainer.padding_free
        if args.check:
            result["isolation"] = trl_isolation(trainer)
    return result


def finish(recorder: Recorder, args) -> dict:
    steps = len(recorder.times)
    result = C.window_throughput(recorder.times, recorder.tokens[:steps], args.warmup, recorder.cpu)
    if recorder.losses:
        result.update(first_loss=recorder.losses[0], last_loss=recorder.losses[-1])
    return result


# ---- do packed samples see each other? -----------------------------------------------------------------

def segments_of(input_ids, position_ids, eos_id: int) -> list[tuple[int, int, int]]:
    """(row, start, end) per sample: a sample starts where position_ids restart at 0, or (no position ids:
    wrapped packing) right after each eos."""
    segments = []
    for r in range(input_ids.size(0)):
        if position_ids is not None:
            starts = (position_ids[r] == 0).nonzero().flatten().tolist()
        else:
            starts = [0] + [i + 1 for i in (input_ids[r] == eos_id).nonzero().flatten().tolist()
                            if i + 1 < input_ids.size(1)]
        ends = starts[1:] + [input_ids.size(1)]
        segments += [(r, a, b) for a, b in zip(starts, ends) if b - a > 1]
    return segments


def isolation_check(model, forward_kwargs: dict, input_ids, labels, position_ids, eos_id: int) -> dict:
    """The packed forward (exactly the contender's inputs) against each sample run alone.

    packed_loss is the contender's own loss on the batch (every label of the row, shifted across the row);
    unpacked_loss the same samples one by one. Equal (to ~1e-6) iff attention stays inside each sample and
    no target crosses a boundary."""
    import torch
    import torch.nn.functional as F

    model.eval()
    with torch.no_grad():
        logits = model(**forward_kwargs).logits.float()  # (B, T, V)
        targets = labels[:, 1:]
        packed_sum = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1),
                                     ignore_index=C.IGNORE_INDEX, reduction="sum").item()
        packed_n = int((targets != C.IGNORE_INDEX).sum())
        ref_sum, ref_n, max_diff, segments = 0.0, 0, 0.0, segments_of(input_ids, position_ids, eos_id)
        for r, a, b in segments:
            seg_labels = labels[r, a:b]
            keep = seg_labels[1:] != C.IGNORE_INDEX  # (len-1,)
            if not keep.any():
                continue
            alone = model(input_ids=input_ids[r:r + 1, a:b], use_cache=False).logits.float()[0]  # (len, V)
            ref_sum += F.cross_entropy(alone[:-1][keep], seg_labels[1:][keep], reduction="sum").item()
            ref_n += int(keep.sum())
            max_diff = max(max_diff, (alone[:-1][keep] - logits[r, a:b - 1][keep]).abs().max().item())
    packed_loss, unpacked_loss = packed_sum / max(packed_n, 1), ref_sum / max(ref_n, 1)
    return {"packed_loss": packed_loss, "unpacked_loss": unpacked_loss,
            "rel_loss_diff": abs(packed_loss - unpacked_loss) / unpacked_loss, "max_abs_logit_diff": max_diff,
            "samples_checked": len(segments), "cross_boundary_targets": packed_n - ref_n,
            "isolated": max_diff < 1e-3 and packed_n == ref_n}


def trl_isolation(trainer) -> dict:
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._prepare_inputs(batch)
    forward = {k: v for k, v in inputs.items() if k != "labels"}
    forward["use_cache"] = False  # what SFTTrainer.compute_loss passes
    return isolation_check(trainer.model, forward, inputs["input_ids"], inputs["labels"], inputs.get("position_ids"),
                           C.tokenizer().eos_token_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=["plain", "hf", "trl"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--variant", default="default", choices=sorted(TRL_VARIANTS))
    parser.add_argument("--check", action="store_true", help="also run the packing isolation check")
    parser.add_argument("--out")
    parser.add_argument("--device", default="cpu")  # plain loop only (the gpu suite)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int)
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()
    C.set_threads()
    result = {"plain": run_plain, "hf": run_hf, "trl": run_trl}[args.contender](args)
    C.write_result(args.out, result)


if __name__ == "__main__":
    main()
