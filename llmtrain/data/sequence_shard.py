"""A batch cut into sequence shards for Ulysses sequence parallelism (models/ulysses.py): sp rank r holds the
contiguous tokens [r·T/sp, (r+1)·T/sp) of every row.

What must stay true across the cut (`shard_batch`):
- targets are shifted BEFORE the cut: the target of a shard's last token is the next shard's first token, which
  this rank never sees (the shard's labels are its targets: `Batch.shifted`);
- rows are padded to a multiple of sp (padding, never refusal): the tail carries no target, and under causal
  attention no real token sees it;
- each shard keeps its rows' own position ids (packed rows restart per sample; unpacked rows count from 0 at the
  row's start, not the shard's), because rotary is applied before the exchange;
- the attention inputs are those of the whole rows (`for_attention` runs before the cut): after the exchange a
  rank attends over whole rows, so a packed sample split by the cut still attends only within itself;
- every target is counted once: a shard's `num_targets` are its own, and sp peers' counts add up to the row's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from llmtrain.data.collate import Batch
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.fused_head import shifted_targets

POSITION_IDS = "position_ids"


def pad_to_multiple(batch: Batch, sp: int, pad_token_id: int = 0) -> Batch:
    """(B, T) -> (B, ⌈T/sp⌉·sp): right padding that carries no loss (a packed row's tail is a segment of its own)."""
    extra = -batch.width % sp
    if extra == 0:
        return batch
    padded = replace(batch, input_ids=F.pad(batch.input_ids, (0, extra), value=pad_token_id),
                     labels=F.pad(batch.labels, (0, extra), value=IGNORE_INDEX))
    if isinstance(batch.attention_mask, torch.Tensor) and batch.attention_mask.dim() == 2:
        padded = replace(padded, attention_mask=F.pad(batch.attention_mask, (0, extra), value=0))
    elif batch.attention_mask is not None:
        raise ValueError("pad_to_multiple runs before for_attention: a batch with a 4-D mask cannot be padded")
    if batch.position_ids is not None:
        padded = replace(padded, position_ids=F.pad(batch.position_ids, (0, extra), value=0))
    return padded


def shard_batch(batch: Batch, sp_rank: int, sp: int) -> Batch:
    """This sp rank's shard of a padded batch (width a multiple of sp) whose attention inputs were built for the
    whole rows (`for_attention`, on the host). Runs on the host: the target count needs no device sync."""
    if batch.width % sp:
        raise ValueError(f"shard_batch: width {batch.width} is not a multiple of sp={sp} (pad_to_multiple first)")
    if batch.shifted:
        raise ValueError("shard_batch: the batch is already a shard")
    if isinstance(batch.attention_mask, torch.Tensor) and batch.attention_mask.dim() > 2:
        raise ValueError("shard_batch: a dense (B, 1, T, T) mask cannot follow its rows through the all-to-all; "
                         "sequence parallelism attends with sdpa_segments")
    local = batch.width // sp
    start, end = sp_rank * local, (sp_rank + 1) * local
    targets = shifted_targets(batch.labels)[:, start:end]  # (B, T/sp): shifted on the whole row, then cut
    whole_positions = batch.position_ids if batch.position_ids is not None else \
        torch.arange(batch.width).expand(batch.input_ids.shape[0], -1)  # (B, T)
    positions = whole_positions[:, start:end].contiguous()  # (B, T/sp)
    kwargs = dict(batch.attention_kwargs)
    if batch.position_ids is None:  # unpacked: the shard's positions go in as a model argument, the batch stays
        kwargs[POSITION_IDS] = positions  # unpacked (no segment lengths needed)
    return replace(batch, input_ids=batch.input_ids[:, start:end].contiguous(), labels=targets.contiguous(),
                   attention_mask=None, position_ids=positions if batch.position_ids is not None else None,
                   num_targets=int((targets != IGNORE_INDEX).sum()), attention_kwargs=kwargs, shifted=True,
                   row_lengths=tuple(min(max(length - start, 0), local) for length in batch.row_lengths))


def sequence_preparer(attn_implementation: str, sp_rank: int, sp: int, group=None):
    """Batch (host) -> this rank's shard with the whole rows' attention inputs: pad, for_attention, cut. A stage's
    own batch type that holds more than rows (a pair batch: stages/pair_shard.py) cuts itself with its
    `sequence_shard(attn_implementation, sp_rank, sp, group)`; `group`, the sp peers', is what it sums over."""

    def prepare(batch):
        own = getattr(batch, "sequence_shard", None)
        if own is not None:
            return own(attn_implementation, sp_rank, sp, group)
        return shard_batch(pad_to_multiple(batch, sp).for_attention(attn_implementation), sp_rank, sp)

    return prepare
