"""Ring attention (`backend.cp`): each cp rank keeps its queries while the key/value blocks go round the ring.

A row is cut into 2·cp chunks of c tokens; cp rank i holds chunks i and 2·cp−1−i (zig-zag: under causal masking
every rank then does the same work at every step; contiguous sharding, one chunk per rank, leaves rank 0 idle after
its first step and rank cp−1 working at all of them). Step t of the ring: rank r attends its query chunks to the
key/value chunks of rank r − t, while it passes that block on to rank r + 1 (point to point, cp − 1 sends of
(k, v) per layer). A pair of chunks (query chunk a, key chunk b) runs as one kernel call: b > a sees nothing, b < a
sees everything, b = a is causal; in packed rows (the whole rows' `segment_lengths`) one call per sample that meets
itself in the pair, so no mask is built (memory stays O(c), not O(c²)). The partial outputs merge exactly through
their log-sum-exps. Backward runs the ring again: each block's key/value gradients travel with it and reach their
owner after cp sends; every pair's gradients come from the flash backward given the merged output and log-sum-exp
(what the whole row's attention would have saved).

Kernels: on the CPU the flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, GQA native); on CUDA the
memory-efficient kernel (kv-heads repeated for GQA). The CUDA path is untested here (no GPU in CI). Registered
with transformers under a name of the run's own, as models/ulysses.py does; the Ulysses exchange can wrap it (sp
inside, cp across: `ulysses_attention(ring_name, ...)`).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from llmtrain.models.attention import SEGMENT_LENGTHS, _no_dense_mask

ZIGZAG, CONTIGUOUS = "zigzag", "contiguous"
_names = itertools.count()
KV_TAG, GRAD_TAG = 1, 2


def chunks_of(rank: int, cp: int, layout: str = ZIGZAG) -> tuple[int, ...]:
    """The row chunks cp rank `rank` holds, in order: zig-zag (i, 2·cp−1−i) of 2·cp chunks; contiguous (i,) of cp."""
    return (rank, 2 * cp - 1 - rank) if layout == ZIGZAG else (rank,)


def chunk_count(cp: int, layout: str = ZIGZAG) -> int:
    return 2 * cp if layout == ZIGZAG else cp


@functools.lru_cache(maxsize=8)
def ring_plan(segment_lengths: tuple | None, rank: int, cp: int, layout: str, c: int) -> tuple:
    """Per ring step, the chunk pairs this rank computes: (i, j, causal, blocks) for its i-th query chunk a against
    the j-th key chunk b of the block it holds at that step. b > a sees nothing (left out), b < a everything, b = a
    causally. Packed rows (`segment_lengths`: per row, the whole row's sample lengths) keep their samples apart:
    `blocks` lists the (row, q0, q1, k0, k1) rectangles, offsets in the chunks, where one sample meets itself (each
    query row in at most one; causal on the diagonal, where the two ranges are the same), None where one sample
    covers both chunks of every row. Host ints only: no mask is ever built, and every layer reuses the plan."""
    steps = []
    for step in range(cp):
        mine, theirs = chunks_of(rank, cp, layout), chunks_of((rank - step) % cp, cp, layout)
        pairs = []
        for (i, a), (j, b) in itertools.product(enumerate(mine), enumerate(theirs)):
            if b > a:
                continue
            blocks = None if segment_lengths is None else _sample_blocks(segment_lengths, a, b, c)
            if blocks is None or blocks:
                pairs.append((i, j, a == b, blocks))
        steps.append(tuple(pairs))
    return tuple(steps)


def _sample_blocks(segment_lengths: tuple, a: int, b: int, c: int) -> tuple | None:
    """(row, q0, q1, k0, k1) where a packed sample holds queries of chunk a and keys of chunk b; None: one sample
    covers both chunks whole in every row."""
    blocks, whole = [], True
    for row, lengths in enumerate(segment_lengths):
        start = 0
        for length in lengths:
            end = start + length
            q0, q1, k0, k1 = max(start, a * c), min(end, (a + 1) * c), max(start, b * c), min(end, (b + 1) * c)
            if q0 < q1 and k0 < k1:
                blocks.append((row, q0 - a * c, q1 - a * c, k0 - b * c, k1 - b * c))
                whole &= q1 - q0 == c and k1 - k0 == c
            start = end
    return None if whole and len(blocks) == len(segment_lengths) else tuple(blocks)


class _Kernel:
    """One block of queries against one block of keys, no mask: forward -> (out (B, H, q, D), lse (B, H, q) fp32),
    backward -> (dq, dk, dv)."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out, lse.float()
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]].float()  # the kernel pads lse to a multiple of 32 queries

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale):
        dout, q, k, v, out, lse = (x.contiguous() for x in (dout, q, k, v, out, lse))
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        groups = q.shape[1] // k.shape[1]
        padded = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))  # as the forward kernel returned it
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), None, out, padded, empty, empty, 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


def _pair_forward(q, k, v, causal: bool, blocks, scale):
    """q (B, H, c, D) of a query chunk, k/v (B, KV, c, D) of a key chunk -> (out (B, H, c, D), lse (B, H, c) fp32);
    with `blocks` only those rectangles (a query row in none: out 0, lse -inf)."""
    if blocks is None:
        return _Kernel.forward(q, k, v, causal, scale)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    for row, q0, q1, k0, k1 in blocks:
        r = slice(row, row + 1)
        out[r, :, q0:q1], lse[r, :, q0:q1] = _Kernel.forward(q[r, :, q0:q1], k[r, :, k0:k1], v[r, :, k0:k1], causal,
                                                             scale)
    return out, lse


def _pair_backward(dout, q, k, v, out, lse, causal: bool, blocks, scale):
    """The gradients of one pair given the merged out and lse: (dq (B, H, c, D), dk, dv (B, KV, c, D))."""
    if blocks is None:
        return _Kernel.backward(dout, q, k, v, out, lse, causal, scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for row, q0, q1, k0, k1 in blocks:
        r, qs, ks = slice(row, row + 1), slice(q0, q1), slice(k0, k1)
        grads = _Kernel.backward(dout[r, :, qs], q[r, :, qs], k[r, :, ks], v[r, :, ks], out[r, :, qs], lse[r, :, qs],
                                 causal, scale)
        dq[r, :, qs] += grads[0]
        dk[r, :, ks] += grads[1]
        dv[r, :, ks] += grads[2]
    return dq, dk, dv


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, KV·g, T, D) -> (B, KV, T, D)."""
    b, h, t, d = x.shape
    return x.view(b, h // groups, groups, t, d).sum(2)


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, blk_out: torch.Tensor, blk_lse: torch.Tensor):
    """Two partial attentions over disjoint keys -> theirs over both (out (B, H, c, D) fp32, lse (B, H, c))."""
    if out is None:
        return blk_out.float(), blk_lse
    new = torch.logaddexp(lse, blk_lse)
    old_w = torch.exp(lse - new).nan_to_num(0.0)[..., None]  # nan only where neither saw a key (both outputs 0)
    blk_w = torch.exp(blk_lse - new).nan_to_num(0.0)[..., None]
    return out * old_w + blk_out.float() * blk_w, new


def exchange(ops: list) -> list:
    """The one call every block of the ring goes through (metrics/comm.py counts its sends while counting)."""
    return dist.batch_isend_irecv(ops)


class _Ring:
    """The cp ring over `group`: (k, v) blocks passed from rank r to r + 1."""

    def __init__(self, group):
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)

    def start(self, tensor: torch.Tensor, tag: int) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Send `tensor` on to the next rank, receive the previous rank's into a new buffer (asynchronous). One tag
        per kind of block in flight (k/v, their gradients): messages of two kinds to the same peer never match."""
        got = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, group=self.group, tag=tag, group_peer=(self.rank + 1) % self.size),
               dist.P2POp(dist.irecv, got, group=self.group, tag=tag, group_peer=(self.rank - 1) % self.size)]
        return exchange(ops), got, tensor  # the sent tensor lives until the send is done

    @staticmethod
    def finish(pending: tuple[list, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        for work in pending[0]:
            work.wait()
        return pending[1]


class RingAttention(torch.autograd.Function):
    """q (B, H, L, D), k/v (B, KV, L, D): this rank's L tokens (its chunks of c, in order) -> out (B, H, L, D), over
    the pairs of `ring_plan`."""

    @staticmethod
    def forward(ctx, q, k, v, group, plan: tuple, c: int, scale):
        ring, outs, lses = _Ring(group), {}, {}
        kv = torch.stack([k, v])  # (2, B, KV, L, D)
        for step, pairs in enumerate(plan):
            pending = ring.start(kv, KV_TAG) if step < ring.size - 1 else None
            for i, j, causal, blocks in pairs:
                blk = _pair_forward(q[:, :, i * c:(i + 1) * c], kv[0][:, :, j * c:(j + 1) * c],
                                    kv[1][:, :, j * c:(j + 1) * c], causal, blocks, scale)
                outs[i], lses[i] = _merge(outs.get(i), lses.get(i), *blk)
            kv = ring.finish(pending) if pending else kv
        out = torch.cat([outs[i] for i in sorted(outs)], dim=2).to(q.dtype)  # (B, H, L, D)
        lse = torch.cat([lses[i] for i in sorted(lses)], dim=2)  # (B, H, L) fp32
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.scale, ctx.c = group, plan, scale, c
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, c, dout = _Ring(ctx.group), ctx.c, dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, L, D)
        kv, grads_in = torch.stack([k, v]), None
        for step, pairs in enumerate(ctx.plan):
            pending = ring.start(kv, KV_TAG) if step < ring.size - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # (2, B, KV, L, D) this block's
            for i, j, causal, blocks in pairs:
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                dqi, dkj, dvj = _pair_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                               out[:, :, qs], lse[:, :, qs], causal, blocks, ctx.scale)
                dq[:, :, qs] += dqi
                dkv[0][:, :, ks] += dkj
                dkv[1][:, :, ks] += dvj
            if grads_in is not None:
                dkv += ring.finish(grads_in)  # what the ranks before me added to this block
            if ring.size > 1:
                grads_in = ring.start(dkv, GRAD_TAG)  # the block's gradients reach their owner after cp sends
            kv = ring.finish(pending) if pending else kv
        dkv = ring.finish(grads_in) if grads_in is not None else dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: str = ZIGZAG,
                   segment_lengths: tuple | None = None, scale: float | None = None) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, KV, L, D) of this rank's chunks -> (B, H, L, D); `segment_lengths`: the whole rows'
    packed samples (per row, lengths summing to the row's width), kept apart across every chunk pair."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    segments = None if segment_lengths is None else tuple(map(tuple, segment_lengths))
    c = q.shape[2] // len(chunks_of(rank, cp, layout))
    plan = ring_plan(segments, rank, cp, layout, c)
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, plan, c, scale)


def register_ring_attention(cp: int, group, layout: str = ZIGZAG) -> str:
    """Register ring attention over `group` (cp ranks) with transformers under a name of its own, for
    `attn_implementation`; the name contains "sdpa" (transformers checks the family's sdpa support for it)."""
    name = f"ring{next(_names)}_cp{cp}_sdpa"

    def attention(module, query, key, value, attention_mask, **kwargs):
        # query (B, H, L, D), key/value (B, KV, L, D): this rank's chunks (local heads under tp / sp)
        if kwargs.get("sliding_window") is not None:
            raise ValueError("ring attention has no sliding window: backend.cp needs a model without one")
        scale = kwargs.get("scaling", getattr(module, "scaling", None))
        out = ring_attention(query, key, value, group, layout, kwargs.get(SEGMENT_LENGTHS), scale)
        return out.transpose(1, 2).contiguous(), None  # (B, L, H, D)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _no_dense_mask)
    return name
