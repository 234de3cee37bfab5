"""From the data settings to batches: sources -> formats -> (packing) -> per-step micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader

from llmtrain.data.collate import FILLER, Batch
from llmtrain.data.dataset import TokenizedExamples, build_examples
from llmtrain.data.formats import DataStats
from llmtrain.data.sampler import StepBatchSampler
from llmtrain.data.sources import load_rows, split_eval


@dataclass
class DataBundle:
    train: TokenizedExamples
    eval: TokenizedExamples | None
    train_stats: DataStats
    eval_stats: DataStats | None


def build_data(*, train_files: list[str], eval_files: list[str], dataset: str | None, split: str,
               eval_split: str | None, eval_fraction: float, fmt: str, max_seq_len: int, overlong: str,
               packing: bool, tokenizer, seed: int, rename_columns: dict[str, str] | None = None,
               unpaired: bool = False, ignore_columns: tuple[str, ...] = ()) -> DataBundle:
    """`rename_columns`: {data column: the name the format reads} (e.g. reward.margin_column -> margin); `unpaired`:
    the stage trains on unpaired completions (a pair format's pairs unpaired: data/unpaired_format.py)."""
    train_rows = rename(load_rows(list(train_files) or None, dataset, split), rename_columns, "data.train_files")
    eval_rows = None
    if eval_files:
        eval_rows = rename(load_rows(list(eval_files), None, "train", files_field="data.eval_files"), rename_columns,
                           "data.eval_files")
    elif eval_split is not None:
        eval_rows = rename(load_rows(None, dataset, eval_split), rename_columns, "data.eval_split")
    elif eval_fraction > 0:
        train_rows, eval_rows = split_eval(train_rows, eval_fraction, seed)
    options = dict(fmt=fmt, max_seq_len=max_seq_len, overlong=overlong, packing=packing, unpaired=unpaired,
                   ignore_columns=ignore_columns)
    train, train_stats = build_examples(train_rows, tokenizer, **options)
    if eval_rows is None:
        return DataBundle(train, None, train_stats, None)
    evaluation, eval_stats = build_examples(eval_rows, tokenizer, **options)
    return DataBundle(train, evaluation, train_stats, eval_stats)


def load_data(d, *, tokenizer, seed: int, max_prompt_len: int | None = None,
              rename_columns: dict[str, str] | None = None, unpaired: bool = False):
    """The run's data from its `data` config node: prompts to generate from when `max_prompt_len` is given (RL
    stages), else tokenised training sequences."""
    sources = dict(train_files=d.train_files, eval_files=d.eval_files, dataset=d.dataset, split=d.split,
                   eval_split=d.eval_split, eval_fraction=d.eval_fraction, fmt=d.format, tokenizer=tokenizer, seed=seed)
    if max_prompt_len is not None:
        from llmtrain.data.prompts import build_prompt_data

        return build_prompt_data(**sources, max_prompt_len=max_prompt_len)
    return build_data(**sources, max_seq_len=d.max_seq_len, overlong=d.overlong, packing=d.packing,
                      rename_columns=rename_columns, unpaired=unpaired, ignore_columns=tuple(d.ignore_columns))


def rename(rows, renames: dict[str, str] | None, where: str):
    """Columns renamed to what the format reads; a missing one names the setting that asked for it."""
    from llmtrain.data.errors import DataConfigError

    for column, name in (renames or {}).items():
        if column not in rows.column_names:
            raise DataConfigError(f"{where}: the data has no column {column!r} (reward.margin_column names it; "
                                  f"columns: {sorted(rows.column_names)}): fix the name or set it to null")
        if column != name:
            rows = rows.rename_column(column, name)
    return rows


def train_batches(examples: TokenizedExamples, *, micro_batch_size: int, grad_accum_steps: int, dp_rank: int,
                  dp_size: int, seed: int, collate_fn: Callable[[list[dict]], Batch], num_workers: int,
                  start_step: int, group_by_length: bool = False) -> Iterator[Batch]:
    """Micro-batches for this rank from optimizer step `start_step` on, endlessly (epochs roll over)."""
    sampler = StepBatchSampler(len(examples), micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                               dp_rank=dp_rank, dp_size=dp_size, seed=seed, start_step=start_step,
                               lengths=examples.row_lengths() if group_by_length else None)
    loader = DataLoader(examples, batch_sampler=sampler, num_workers=num_workers,
                        collate_fn=collate_fn,
                        # a private generator: worker seeding never draws from the global RNG
                        generator=torch.Generator().manual_seed(seed),
                        persistent_workers=num_workers > 0)
    return iter(loader)


def eval_batches(examples: TokenizedExamples, *, batch_size: int, dp_rank: int, dp_size: int,
                 collate_fn: Callable[[list[dict]], Batch]) -> Callable[[], Iterator[Batch]]:
    """Every held-out example exactly once across ranks; every rank runs the same number of batches
    (a rank that runs out gets a filler example, marked FILLER: its collate makes it add nothing to the
    sums, while the forward still runs, as sharded engines need every rank in their collectives)."""
    mine = list(range(dp_rank, len(examples), dp_size))
    per_rank = -(-len(examples) // dp_size)
    num_batches = -(-per_rank // batch_size)

    def batches() -> Iterator[Batch]:
        for b in range(num_batches):
            chunk = [examples[i] for i in mine[b * batch_size:(b + 1) * batch_size]]
            if not chunk:
                chunk = [{**examples[0], FILLER: True}]
            yield collate_fn(chunk)

    return batches
