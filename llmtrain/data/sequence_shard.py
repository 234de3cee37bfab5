"""A batch cut into sequence shards for Ulysses sequence parallelism (models/ulysses.py): sp rank r holds the
contiguous tokens [r·T/sp, (r+1)·T/sp) of every row. Under context parallelism (models/ring_attention.py) the row is
cut into 2·cp chunks and cp rank i holds chunks i and 2·cp−1−i (zig-zag), which its sp peers split contiguously:
`shard_positions` says which tokens of the row a rank holds, always in increasing order.

What must stay true across the cut (`shard_batch`):
- targets are shifted BEFORE the cut: the target of a shard's last token is the next shard's first token, which
  this rank never sees (the shard's labels are its targets: `Batch.shifted`);
- rows are padded to a multiple of sp, or 2·cp·sp (padding, never refusal): the tail carries no target, and under causal
  attention no real token sees it;
- each shard keeps its rows' own position ids (packed rows restart per sample; unpacked rows count from 0 at the
  row's start, not the shard's), because rotary is applied before the exchange;
- the attention inputs are those of the whole rows (`for_attention` runs before the cut): after the exchange a
  rank attends over whole rows, so a packed sample split by the cut still attends only within itself;
- every target is counted once: a shard's `num_targets` are its own, and sp peers' counts add up to the row's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from llmtrain.data.collate import Batch
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.fused_head import shifted_targets

POSITION_IDS = "position_ids"


def row_multiple(size: int, cp: int = 1) -> int:
    """What a row's width must be a multiple of for `size` ranks sharing it, cp of them a ring: 2·cp·sp, or sp."""
    return 2 * size if cp > 1 else size


def shard_positions(width: int, rank: int, size: int, cp: int = 1) -> torch.Tensor:
    """(width / size,) long: the row positions rank `rank` of the `size` ranks sharing each row (cp × sp, cp outer)
    holds, increasing. cp 1: a contiguous shard; else cp rank i's chunks i and 2·cp−1−i, cut contiguously over sp."""
    if cp == 1:
        local = width // size
        return torch.arange(rank * local, (rank + 1) * local)
    from llmtrain.models.ring_attention import chunks_of

    sp, chunk = size // cp, width // (2 * cp)
    ring = torch.cat([torch.arange(a * chunk, (a + 1) * chunk) for a in chunks_of(rank // sp, cp)])  # (width/cp,)
    local = ring.shape[0] // sp
    return ring[rank % sp * local:(rank % sp + 1) * local]


@dataclass(frozen=True)
class RowShare:
    """The ranks that share each row (cp × sp, cp outer; ParallelDims.row_share): this rank among them, how many, the
    group a pair batch's per-sequence sums are summed over, and how many of them form the ring (cp)."""
    rank: int = 0
    size: int = 1
    group: object = None
    cp: int = 1

    @property
    def multiple(self) -> int:
        """What each row's width is padded to a multiple of: 2·cp·sp, or sp."""
        return row_multiple(self.size, self.cp)

    def positions(self, width: int) -> torch.Tensor:
        """(width / size,) long: the row positions this rank holds, increasing (shard_positions)."""
        return shard_positions(width, self.rank, self.size, self.cp)


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


def shard_batch(batch: Batch, rows: RowShare) -> Batch:
    """This rank's shard of a padded batch (width a multiple of `rows.multiple`) whose attention inputs were built for
    the whole rows (`for_attention`, on the host). Runs on the host: the target count needs no device sync."""
    if batch.width % rows.multiple:
        raise ValueError(f"shard_batch: width {batch.width} is not a multiple of {'sp' if rows.cp == 1 else '2·cp·sp'}="
                         f"{rows.multiple} (pad_to_multiple first)")
    if batch.shifted:
        raise ValueError("shard_batch: the batch is already a shard")
    if isinstance(batch.attention_mask, torch.Tensor) and batch.attention_mask.dim() > 2:
        raise ValueError("shard_batch: a dense (B, 1, T, T) mask cannot follow its rows through the all-to-all; "
                         "sequence parallelism attends with sdpa_segments")
    index = rows.positions(batch.width)  # (T/sp,) increasing
    targets = shifted_targets(batch.labels)[:, index]  # (B, T/sp): shifted on the whole row, then cut
    whole_positions = batch.position_ids if batch.position_ids is not None else \
        torch.arange(batch.width).expand(batch.input_ids.shape[0], -1)  # (B, T)
    positions = whole_positions[:, index].contiguous()  # (B, T/sp)
    kwargs = dict(batch.attention_kwargs)
    if batch.position_ids is None:  # unpacked: the shard's positions go in as a model argument, the batch stays
        kwargs[POSITION_IDS] = positions  # unpacked (no segment lengths needed)
    return replace(batch, input_ids=batch.input_ids[:, index].contiguous(), labels=targets.contiguous(),
                   attention_mask=None, position_ids=positions if batch.position_ids is not None else None,
                   num_targets=int((targets != IGNORE_INDEX).sum()), attention_kwargs=kwargs, shifted=True,
                   row_lengths=tuple(int((index < length).sum()) for length in batch.row_lengths))


def sequence_preparer(attn_implementation: str, rows: RowShare):
    """Batch (host) -> this rank's shard with the whole rows' attention inputs: pad, for_attention, cut. A stage's own
    batch type that holds more than rows (a pair batch: stages/pair_shard.py) cuts itself with its
    `sequence_shard(attn_implementation, rows)`, summing over `rows.group`."""

    def prepare(batch):
        own = getattr(batch, "sequence_shard", None)
        if own is not None:
            return own(attn_implementation, rows)
        padded = pad_to_multiple(batch, rows.multiple)
        return shard_batch(padded.for_attention(attn_implementation), rows)

    return prepare
