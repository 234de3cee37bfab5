"""Prompts for the RL stages (PPO, GRPO): what the actor continues, and what a reward function reads.

Each row gives its prompt tokens, encoded as the SFT stage encodes a prompt (bos + text, or the chat
template with the generation prompt), so the actor continues exactly what it was trained on; the raw
prompt (the column's value: a string or a list of messages, never the templated text); and the row's
other columns (a reference answer, a test case...), passed to a reward function as keyword lists.

- `prompt`: a `prompt` column (string or messages).
- `prompt_response`: `prompt`, and `response` (or `completion`) kept as a column (the reference).
- `messages`: every message before the last assistant turn is the prompt; that turn's content is the
  `response` column.
A prompt longer than `max_prompt_len` (data.max_seq_len − ppo.rollout.max_new_tokens) is dropped, and
counted: cutting it would remove the instruction the response answers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import datasets
import torch

from llmtrain.data.collate import FILLER
from llmtrain.data.errors import DataConfigError
from llmtrain.data.sources import load_rows, split_eval
from llmtrain.data.tokens import bos_ids, chat_ids, text_ids

PROMPT_FORMATS = ("prompt", "prompt_response", "messages")
REFERENCE = "response"  # the column name a reference answer travels under, whatever the format called it


def split_row(row: dict, fmt: str) -> tuple[object, dict]:
    """(raw prompt, other columns) of a row."""
    if fmt == "messages":
        messages = list(row["messages"])
        if not messages or messages[-1].get("role") != "assistant":
            return messages, {k: v for k, v in row.items() if k != "messages"}
        return messages[:-1], {**{k: v for k, v in row.items() if k != "messages"}, REFERENCE: messages[-1]["content"]}
    columns = {k: v for k, v in row.items() if k != "prompt"}
    if fmt == "prompt_response" and "completion" in columns and REFERENCE not in columns:
        columns[REFERENCE] = columns.pop("completion")
    return row["prompt"], columns


def encode_prompt(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return bos_ids(tokenizer) + text_ids(tokenizer, prompt)
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataConfigError("a prompt given as messages needs a chat template, but model.tokenizer has none; "
                              "give prompts as strings or use a tokenizer with a chat template")
    return chat_ids(tokenizer, list(prompt), add_generation_prompt=True)


class PromptExamples(torch.utils.data.Dataset):
    """Row i: {"prompt_ids", "prompt" (raw), "columns" (the row's other columns)}."""

    def __init__(self, rows: datasets.Dataset, fmt: str, prompt_ids: list[list[int]], kept: list[int]):
        self.rows, self.fmt, self.prompt_ids, self.kept = rows, fmt, prompt_ids, kept

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, index: int) -> dict:
        row = self.rows[self.kept[int(index)]]
        prompt, columns = split_row(row, self.fmt)
        return {"prompt_ids": self.prompt_ids[int(index)], "prompt": prompt, "columns": columns}

    def row_lengths(self) -> list[int]:
        return [len(ids) for ids in self.prompt_ids]


@dataclass
class PromptStats:
    samples_in: int
    samples_out: int
    dropped_overlong: int
    longest_prompt: int

    def summary(self) -> str:
        return (f"prompts_in={self.samples_in} prompts_kept={self.samples_out} "
                f"dropped_overlong={self.dropped_overlong} longest_prompt={self.longest_prompt}")


def build_prompts(rows: datasets.Dataset, tokenizer, fmt: str,
                  max_prompt_len: int) -> tuple[PromptExamples, PromptStats]:
    if fmt not in PROMPT_FORMATS:
        raise DataConfigError(f"data.format={fmt!r}: the RL stages read prompts from one of "
                              f"{', '.join(PROMPT_FORMATS)}")
    needed = "messages" if fmt == "messages" else "prompt"
    if needed not in rows.column_names:
        raise DataConfigError(f"data.format={fmt} needs a column {needed!r}, but the data has columns "
                              f"{sorted(rows.column_names)}; rename the column or set data.format to match")
    encoded = [encode_prompt(split_row(row, fmt)[0], tokenizer) for row in rows]
    kept = [i for i, ids in enumerate(encoded) if 0 < len(ids) <= max_prompt_len]
    stats = PromptStats(len(rows), len(kept), len(rows) - len(kept), max((len(e) for e in encoded), default=0))
    if not kept:
        raise DataConfigError(f"no prompt fits in {max_prompt_len} tokens (data.max_seq_len minus "
                              f"ppo.rollout.max_new_tokens; the longest prompt has {stats.longest_prompt}): "
                              "raise data.max_seq_len or lower ppo.rollout.max_new_tokens")
    return PromptExamples(rows, fmt, [encoded[i] for i in kept], kept), stats


@dataclass
class PromptData:
    train: PromptExamples
    eval: PromptExamples | None
    train_stats: PromptStats
    eval_stats: PromptStats | None


def build_prompt_data(*, train_files: list[str], eval_files: list[str], dataset: str | None, split: str,
                      eval_split: str | None, eval_fraction: float, fmt: str, max_prompt_len: int, tokenizer,
                      seed: int) -> PromptData:
    train_rows = load_rows(list(train_files) or None, dataset, split)
    eval_rows = None
    if eval_files:
        eval_rows = load_rows(list(eval_files), None, "train", files_field="data.eval_files")
    elif eval_split is not None:
        eval_rows = load_rows(None, dataset, eval_split)
    elif eval_fraction > 0:
        train_rows, eval_rows = split_eval(train_rows, eval_fraction, seed)
    train, train_stats = build_prompts(train_rows, tokenizer, fmt, max_prompt_len)
    if eval_rows is None:
        return PromptData(train, None, train_stats, None)
    evaluation, eval_stats = build_prompts(eval_rows, tokenizer, fmt, max_prompt_len)
    return PromptData(train, evaluation, train_stats, eval_stats)


@dataclass
class PromptBatch:
    """Prompts left-padded for generation: real tokens end at the same column in every row."""
    input_ids: torch.Tensor  # (B, P) long
    attention_mask: torch.Tensor  # (B, P) long, 0 on the left padding
    prompts: list  # raw prompt of each row (what a reward function reads)
    columns: dict[str, list]  # the rows' other columns, one list per column
    real: torch.Tensor  # (B,) bool: False for an eval filler row (keeps a rank in step, counts nothing)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PromptBatch:
        return replace(self, input_ids=self.input_ids.to(device, non_blocking=non_blocking),
                       attention_mask=self.attention_mask.to(device, non_blocking=non_blocking),
                       real=self.real.to(device))

    def for_attention(self, attn_implementation: str, mask_dtype: torch.dtype = torch.float32) -> PromptBatch:
        return self  # generation and scoring build their own masks from attention_mask

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


def collate_prompts(examples: list[dict], pad_token_id: int) -> PromptBatch:
    width = max(len(e["prompt_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["prompt_ids"])
        ids[i, width - n:] = torch.tensor(e["prompt_ids"], dtype=torch.long)
        mask[i, width - n:] = 1
    names = sorted({name for e in examples for name in e["columns"]})
    columns = {name: [e["columns"].get(name) for e in examples] for name in names}
    real = torch.tensor([not e.get(FILLER, False) for e in examples])
    return PromptBatch(ids, mask, [e["prompt"] for e in examples], columns, real)
