"""Pairs under Ulysses sequence parallelism: a PairBatch cut into sequence shards, and the sums over the sp peers
that give every peer each sequence's whole value.

The rows are cut as any batch is (data/sequence_shard.py: padded to a multiple of sp, targets shifted before the cut,
the whole rows' attention inputs), and so is what says which sequence a target belongs to: on a shard,
`sequence_ids` holds the sequence of the token each position predicts (shifted before the cut, as the labels are).
A sequence's summed log-prob and its target count are then partial on each peer, and its last token (the reward
model's score) lives on exactly one peer: `SumOverPeers` adds the peers' parts, so every peer holds the whole
sequence's value and computes the same losses and statistics.

Each pair must still count once in the loss, its gradient and the logged sums, which the backends and the Updater
add over dp × sp ranks. So the shard of sp rank 0 keeps the pairs (`share` 1: its loss, statistics and pair count)
and its peers' shards `share` 0. The gradient, derived: every peer r holds ℓ_r = share_r · L(S) with
S = Σ_r' S_r' (S_r this peer's partial sums), and what the ranks' gradients add up to is J = Σ_r ℓ_r = L(S). Then
∂J/∂S_r = Σ_r' share_r' · L'(S) = L'(S): the backward of the sum is the sum of the peers' incoming gradients (an
all-reduce), which hands every peer L'(S) for its own part, once. (The other choice, an identity backward with every
peer weighing its loss 1, gives the same gradient but counts each pair's loss and statistics sp times.)
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.data.sequence_shard import RowShare, pad_to_multiple, shard_batch


class SumOverPeers(torch.autograd.Function):
    """(N,) this peer's partial sums -> (N,) their sum over the group, on every peer. Backward: the sum over the
    group of the peers' incoming gradients (module docstring: the adjoint of y = Σ_r x_r when J = Σ_r ℓ_r(y))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        total = x.detach().clone().contiguous()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.clone().contiguous()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None


def sum_over_peers(values: torch.Tensor, group) -> torch.Tensor:
    """Per-sequence partial values summed over the sp peers (`group` None: not a shard, returned as they are)."""
    return values if group is None else SumOverPeers.apply(values, group)


def shard_pairs(batch, attn_implementation: str, shares: RowShare):
    """A PairBatch (host, before for_attention) -> this rank's shard of it (`shares`: the ranks sharing each row):
    rows cut with their whole-row attention inputs, `sequence_ids` shifted then cut, each sequence's last token as a
    flat index into this shard's (R·T/sp) positions (-1 on the peers that do not hold it), and the pairs counted on
    rank 0 of the peers only."""
    if batch.rows.shifted:
        raise ValueError("shard_pairs: the batch is already a shard")
    rows = pad_to_multiple(batch.rows, shares.multiple)  # (R, W)
    width, local = rows.width, rows.width // shares.size
    index = shares.positions(width)  # (W/sp,) the row positions this shard holds
    slot = torch.full((width,), -1, dtype=torch.long)
    slot[index] = torch.arange(local)  # (W,) each row position's place in this shard, -1: another peer's
    ids = F.pad(batch.sequence_ids, (0, width - batch.rows.width), value=-1)  # (R, W)
    owners = F.pad(ids[:, 1:], (0, 1), value=-1)[:, index]  # (R, W/sp) sequence of the predicted token
    row, column = batch.ends // batch.rows.width, batch.ends % batch.rows.width  # (2P,) each
    ends = torch.where(slot[column] >= 0, row * local + slot[column], -1)  # (2P,) into this shard's (R, W/sp)
    share = 1.0 if shares.rank == 0 else 0.0
    return replace(batch, rows=shard_batch(rows.for_attention(attn_implementation), shares), ends=ends,
                   sequence_ids=owners.contiguous(), num_pairs=batch.num_pairs if share else 0, share=share,
                   sp_group=shares.group)
