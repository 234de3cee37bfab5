"""Rows -> tokenised (optionally packed) examples, as a torch Dataset backed by arrow."""

import contextlib
from collections.abc import Iterator

import datasets
import torch
import torch.distributed as dist

from llmtrain.data.errors import DataConfigError
from llmtrain.data.formats import (
    CHUNKED,
    TRAINED,
    DataStats,
    check_columns,
    check_length_policy,
    check_tokenizer,
    count_targets,
    encode_row,
    split_chunks,
)
from llmtrain.data.packing import merge_packed, pack_best_fit


class TokenizedExamples(torch.utils.data.Dataset):
    """Tokenised samples (arrow columns `input_ids`, `labels`, `length`) and an optional packing plan.

    Without a plan, item i is sample i. With one, item i merges the samples in plan[i] into one
    packed row (see `merge_packed`).
    """

    def __init__(self, rows: datasets.Dataset, plan: list[list[int]] | None = None):
        self.rows = rows
        self.plan = plan

    def __len__(self) -> int:
        return len(self.rows) if self.plan is None else len(self.plan)

    def __getitem__(self, index: int) -> dict:
        if self.plan is None:
            row = self.rows[int(index)]
            return {"input_ids": row["input_ids"], "labels": row["labels"]}
        group = self.rows[self.plan[int(index)]]  # columns of the group's samples
        samples = [{"input_ids": ids, "labels": labels} for ids, labels in zip(group["input_ids"], group["labels"])]
        return merge_packed(samples)

    def row_lengths(self) -> list[int]:
        """Tokens per item (per packed row when packed)."""
        sample_lengths = list(self.rows["length"])
        if self.plan is None:
            return sample_lengths
        return [sum(sample_lengths[i] for i in group) for group in self.plan]


def build_examples(
    rows: datasets.Dataset,
    tokenizer,
    *,
    fmt: str,
    max_seq_len: int,
    overlong: str = "truncate",
    packing: bool = False,
) -> tuple[TokenizedExamples, DataStats]:
    """Check settings, tokenise once (rank 0 first, others reuse the cache), drop, then pack."""
    check_columns(rows.column_names, fmt)
    check_tokenizer(tokenizer, fmt)
    check_length_policy(max_seq_len, overlong, fmt)
    with main_process_first():
        encoded = rows.map(
            _encode_batch,
            batched=True,
            remove_columns=rows.column_names,
            fn_kwargs={"tokenizer": tokenizer, "fmt": fmt, "max_seq_len": max_seq_len, "overlong": overlong},
            desc=f"tokenising ({fmt})",
        )
        kept = encoded.filter(_is_kept, input_columns="outcome", batched=True, desc="dropping samples")
    stats = DataStats.from_outcomes(list(encoded["outcome"]), list(encoded["length"]), list(encoded["num_targets"]))
    if stats.samples_out == 0:
        raise DataConfigError(f"no sample is left to train on ({stats.summary()}); raise data.max_seq_len, "
                              f"set data.overlong=truncate, or check that data.format={fmt} matches the data")
    kept = kept.select_columns(["input_ids", "labels", "length"])
    plan = pack_best_fit(list(kept["length"]), max_seq_len) if packing else None
    return TokenizedExamples(kept, plan), stats


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the body first; the other ranks wait at a barrier, then run it (hitting the cache).

    A no-op without an initialised process group. If rank 0 fails, it still reaches the barrier,
    so the other ranks run the body and fail the same way instead of hanging.
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    is_main = dist.get_rank() == 0
    if not is_main:
        dist.barrier()
    try:
        yield
    finally:
        if is_main:
            dist.barrier()


def _encode_batch(batch: dict, tokenizer, fmt: str, max_seq_len: int, overlong: str) -> dict:
    columns = list(batch)
    out = {"input_ids": [], "labels": [], "outcome": [], "length": [], "num_targets": []}
    for i in range(len(batch[columns[0]])):
        encoded = encode_row({name: batch[name][i] for name in columns}, tokenizer, fmt, max_seq_len, overlong)
        rows = split_chunks(encoded, max_seq_len) if encoded["outcome"] == CHUNKED else [encoded]
        for row in rows:
            out["input_ids"].append(row["input_ids"])
            out["labels"].append(row["labels"])
            out["outcome"].append(row["outcome"])
            out["length"].append(len(row["input_ids"]))
            out["num_targets"].append(count_targets(row["labels"]))
    return out


def _is_kept(outcomes: list[str]) -> list[bool]:
    return [outcome in TRAINED for outcome in outcomes]
