"""From the data settings to batches: sources -> formats -> (packing) -> per-step micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader

from llmtrain.data.collate import Batch, collate
from llmtrain.data.dataset import TokenizedExamples, build_examples
from llmtrain.data.formats import DataStats
from llmtrain.data.sampler import StepBatchSampler
from llmtrain.data.sources import load_rows, split_eval
from llmtrain.losses.lm import IGNORE_INDEX


@dataclass
class DataBundle:
    train: TokenizedExamples
    eval: TokenizedExamples | None
    train_stats: DataStats
    eval_stats: DataStats | None


def build_data(*, train_files: list[str], eval_files: list[str], dataset: str | None, split: str,
               eval_split: str | None, eval_fraction: float, fmt: str, max_seq_len: int, overlong: str,
               packing: bool, tokenizer, seed: int) -> DataBundle:
    train_rows = load_rows(list(train_files) or None, dataset, split)
    eval_rows = None
    if eval_files:
        eval_rows = load_rows(list(eval_files), None, "train", files_field="data.eval_files")
    elif eval_split is not None:
        eval_rows = load_rows(None, dataset, eval_split)
    elif eval_fraction > 0:
        train_rows, eval_rows = split_eval(train_rows, eval_fraction, seed)
    options = dict(fmt=fmt, max_seq_len=max_seq_len, overlong=overlong, packing=packing)
    train, train_stats = build_examples(train_rows, tokenizer, **options)
    if eval_rows is None:
        return DataBundle(train, None, train_stats, None)
    evaluation, eval_stats = build_examples(eval_rows, tokenizer, **options)
    return DataBundle(train, evaluation, train_stats, eval_stats)


def train_batches(examples: TokenizedExamples, *, micro_batch_size: int, grad_accum_steps: int, dp_rank: int,
                  dp_size: int, seed: int, pad_token_id: int, num_workers: int,
                  start_step: int, group_by_length: bool = False) -> Iterator[Batch]:
    """Micro-batches for this rank from optimizer step `start_step` on, endlessly (epochs roll over)."""
    sampler = StepBatchSampler(len(examples), micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                               dp_rank=dp_rank, dp_size=dp_size, seed=seed, start_step=start_step,
                               lengths=examples.row_lengths() if group_by_length else None)
    loader = DataLoader(examples, batch_sampler=sampler, num_workers=num_workers,
                        collate_fn=partial(collate, pad_token_id=pad_token_id),
                        # a private generator: worker seeding never draws from the global RNG
                        generator=torch.Generator().manual_seed(seed),
                        persistent_workers=num_workers > 0)
    return iter(loader)


def eval_batches(examples: TokenizedExamples, *, batch_size: int, dp_rank: int, dp_size: int,
                 pad_token_id: int) -> Callable[[], Iterator[Batch]]:
    """Every held-out example exactly once across ranks; every rank runs the same number of batches
    (a rank that runs out gets fully-masked filler rows, which add nothing to the sums)."""
    mine = list(range(dp_rank, len(examples), dp_size))
    per_rank = -(-len(examples) // dp_size)
    num_batches = -(-per_rank // batch_size)

    def batches() -> Iterator[Batch]:
        for b in range(num_batches):
            chunk = [examples[i] for i in mine[b * batch_size:(b + 1) * batch_size]]
            if not chunk:
                filler = dict(examples[0])
                filler["labels"] = [IGNORE_INDEX] * len(filler["labels"])
                chunk = [filler]
            yield collate(chunk, pad_token_id=pad_token_id)

    return batches
