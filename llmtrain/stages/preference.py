"""What the pairwise stages (reward model, DPO) share: the batch of pairs and how it is collated.

A micro-batch of P pairs is ONE forward of 2P right-padded rows, chosen rows first (0..P-1), then the
rejected ones (P..2P-1) in the same order: one pass over the weights instead of two, and chosen and
rejected padded to the same width. `trainer.micro_batch_size` counts pairs (as in TRL).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llmtrain.data.collate import FILLER, Batch, collate

HARD = "hard"  # the `kind` of a pair whose eval accuracy is reported apart (eval_accuracy_hard)


@dataclass
class PairBatch:
    rows: Batch  # (2P, T): chosen rows, then rejected rows
    lengths: torch.Tensor  # (2P,) long: real tokens per row; the last one is the EOS
    margin: torch.Tensor  # (P,) float: per-pair margin (0 without a margin column)
    hard: torch.Tensor  # (P,) bool: pairs tagged kind == "hard"
    weight: torch.Tensor  # (P,) float: 1, or 0 for an eval filler pair that only keeps a rank in step
    num_pairs: int  # real pairs (weight 1), counted on the host

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PairBatch":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return replace(self, rows=self.rows.to(device, non_blocking), lengths=move(self.lengths),
                       margin=move(self.margin), hard=move(self.hard), weight=move(self.weight))

    def for_attention(self, attn_implementation: str, mask_dtype: torch.dtype = torch.float32) -> "PairBatch":
        return replace(self, rows=self.rows.for_attention(attn_implementation, mask_dtype))

    def split(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(2P, ...) -> chosen (P, ...), rejected (P, ...)."""
        half = values.shape[0] // 2
        return values[:half], values[half:]


def collate_pairs(examples: list[dict], pad_token_id: int) -> PairBatch:
    """Preference examples (chosen_/rejected_ input_ids and labels, margin, kind) -> one PairBatch."""
    sides = [{"input_ids": e[f"{side}_input_ids"], "labels": e[f"{side}_labels"], FILLER: e.get(FILLER, False)}
             for side in ("chosen", "rejected") for e in examples]
    rows = collate(sides, pad_token_id=pad_token_id)  # right padding: each row's EOS is its last real token
    weight = torch.tensor([0.0 if e.get(FILLER) else 1.0 for e in examples])
    return PairBatch(rows=rows, lengths=torch.tensor([len(s["input_ids"]) for s in sides]),
                     margin=torch.tensor([float(e.get("margin") or 0.0) for e in examples]),
                     hard=torch.tensor([e.get("kind") == HARD for e in examples]), weight=weight,
                     num_pairs=int(weight.sum().item()))


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) padding mask, left or right padded -> (B,) index of each row's last real token."""
    width = attention_mask.shape[1]
    return width - 1 - attention_mask.flip(-1).long().argmax(-1)
