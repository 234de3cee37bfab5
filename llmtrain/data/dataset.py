"""Rows -> tokenised (optionally packed) examples, or preference pairs, as a torch Dataset backed by arrow."""

import contextlib
from collections.abc import Iterator

import datasets
import torch
import torch.distributed as dist

from llmtrain.data.errors import DataConfigError
from llmtrain.data.formats import (
    FORMAT_SPECS,
    DataStats,
    check_columns,
    check_length_policy,
    check_tokenizer,
    count_targets,
    encode_row,
    split_chunks,
)
from llmtrain.data.outcomes import CHUNKED, TRAINED
from llmtrain.data.packing import merge_packed, pack_best_fit
from llmtrain.data.unpaired_format import UNPAIRED_COLUMNS, unpaired_columns

SEQUENCE_COLUMNS = ("input_ids", "labels")
# An item of a preference dataset: both sides (ids and aligned labels), the row's margin and kind,
# `length` (the longer side, for group_by_length) and `num_targets` (both sides' targets).
PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "margin", "kind",
                "length", "num_targets")


class TokenizedExamples(torch.utils.data.Dataset):
    """Tokenised samples (arrow columns `input_ids`, `labels`, `length`) and an optional packing plan.

    Without a plan, item i is sample i (a dict of `columns`). With one, item i merges the samples in
    plan[i] into one packed row (see `merge_packed`). Preference pairs: `columns` is PAIR_COLUMNS, no plan.
    """

    def __init__(self, rows: datasets.Dataset, plan: list[list[int]] | None = None,
                 columns: tuple[str, ...] = SEQUENCE_COLUMNS):
        self.rows = rows
        self.plan = plan
        self.columns = columns

    def __len__(self) -> int:
        return len(self.rows) if self.plan is None else len(self.plan)

    def __getitem__(self, index: int) -> dict:
        if self.plan is None:
            row = self.rows[int(index)]
            return {name: row[name] for name in self.columns}
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
    unpaired: bool = False,
    ignore_columns: tuple[str, ...] = (),
) -> tuple[TokenizedExamples, DataStats]:
    """Check settings, tokenise once (rank 0 first, others reuse the cache), drop, then pack.

    With a preference format, items are pairs (PAIR_COLUMNS) and are never packed. With `unpaired` (a stage that
    trains on unpaired completions, KTO) or the unpaired format, items are UNPAIRED_COLUMNS (data/unpaired_format.py).
    `ignore_columns`: columns carrying a preference signal the format may drop unread (data.ignore_columns).
    """
    check_columns(rows.column_names, fmt, ignore_columns)
    check_tokenizer(tokenizer, fmt)
    check_length_policy(max_seq_len, overlong, fmt)
    kind = FORMAT_SPECS[fmt].example
    pairs = kind == "pair"
    if unpaired and kind == "sequence":
        raise DataConfigError(f"data.format={fmt} gives single sequences without a desirable/undesirable label; "
                              "unpaired completions need data.format=unpaired or preference")
    if kind != "sequence" and packing:
        raise DataConfigError(f"data.packing=true packs single sequences, but data.format={fmt} gives "
                              f"{kind} examples, each kept whole as one example; set data.packing=false")
    encoder = {"pair": _encode_pair_batch, "unpaired": _encode_unpaired_batch}.get(kind, _encode_batch)
    with main_process_first():
        encoded = rows.map(
            encoder,
            batched=True,
            remove_columns=rows.column_names,
            fn_kwargs={"tokenizer": tokenizer, "fmt": fmt, "max_seq_len": max_seq_len, "overlong": overlong},
            desc=f"tokenising ({fmt})",
        )
        kept = encoded.filter(_is_kept, input_columns="outcome", batched=True, desc="dropping samples")
    tokens = encoded["num_tokens" if pairs else "length"]  # a pair's tokens are those of both sides
    stats = DataStats.from_outcomes(list(encoded["outcome"]), list(tokens), list(encoded["num_targets"]))
    if stats.samples_out == 0:
        raise DataConfigError(f"no sample is left to train on ({stats.summary()}); raise data.max_seq_len, "
                              f"set data.overlong=truncate, or check that data.format={fmt} matches the data")
    if unpaired or kind == "unpaired":
        columns = unpaired_columns(kept, max_seq_len, from_pairs=pairs)
        return TokenizedExamples(datasets.Dataset.from_dict(columns), None, UNPAIRED_COLUMNS), stats
    if pairs:
        return TokenizedExamples(kept.select_columns(list(PAIR_COLUMNS)), None, PAIR_COLUMNS), stats
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


def _encode_pair_batch(batch: dict, tokenizer, fmt: str, max_seq_len: int, overlong: str) -> dict:
    columns = list(batch)
    out = {name: [] for name in (*PAIR_COLUMNS, "outcome", "num_tokens")}
    for i in range(len(batch[columns[0]])):
        pair = encode_row({name: batch[name][i] for name in columns}, tokenizer, fmt, max_seq_len, overlong)
        chosen, rejected = pair["chosen_input_ids"], pair["rejected_input_ids"]
        pair["length"] = max(len(chosen), len(rejected))
        pair["num_tokens"] = len(chosen) + len(rejected)
        pair["num_targets"] = count_targets(pair["chosen_labels"]) + count_targets(pair["rejected_labels"])
        for name, values in out.items():
            values.append(pair[name])
    return out


def _encode_unpaired_batch(batch: dict, tokenizer, fmt: str, max_seq_len: int, overlong: str) -> dict:
    columns = list(batch)
    out = {name: [] for name in ("input_ids", "labels", "desirable", "outcome", "length", "num_targets")}
    for i in range(len(batch[columns[0]])):
        row = encode_row({name: batch[name][i] for name in columns}, tokenizer, fmt, max_seq_len, overlong)
        row["length"], row["num_targets"] = len(row["input_ids"]), count_targets(row["labels"])
        for name, values in out.items():
            values.append(row[name])
    return out


def _is_kept(outcomes: list[str]) -> list[bool]:
    return [outcome in TRAINED for outcome in outcomes]
