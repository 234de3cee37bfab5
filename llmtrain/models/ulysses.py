"""Ulysses sequence parallelism: attention over whole rows while every other layer sees s/sp tokens.

Each of the sp peers holds a contiguous shard of every row (data/sequence_shard.py). Around attention, one
all-to-all per tensor turns sequence shards into head shards (q, k, v: (B, H, T/sp, D) -> (B, H/sp, T, D)), the
run's own attention runs on whole rows for its heads, and one more turns the output back ((B, T, H/sp, D) ->
(B, T/sp, H, D)): 4 all-to-alls per layer. After the exchange a rank holds whole rows, so the attention sees what
it sees without sp: the packed rows' per-sample lengths (`segment_lengths`, built for the whole row by
`Batch.for_attention`) and causality apply unchanged, and positions were applied by rotary before (each shard
carries its rows' own position ids). Backward runs the inverse all-to-alls (the exchange is its own transpose).

Why not DeepSpeed's `UlyssesSPAttentionHF` (0.19.8): the FSDP2 backend would import deepspeed (only
backends/deepspeed.py may); it fixes the batch size at construction (shape asserts), all-gathers the position ids
in every layer, writes `module.num_key_value_groups`, and its `register_with_transformers` replaces transformers'
attention functions for the whole process. Here the exchange is a few lines of torch, and each run registers its
own uniquely named attention implementation (`ulysses_attention`): only the models built with that name use it,
so nothing leaks into another role built without sp, evaluation elsewhere, or a later run in the same process.

Fewer kv-heads than sp (per tp rank): each kv-head is repeated so every sp rank gets one (DeepSpeed does the same);
the inner kernel then sees its local groups through a view of the attention module (never written to).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from llmtrain.models.attention import register_segment_attention

_names = itertools.count()


class _AllToAll(torch.autograd.Function):
    """(sp, ...) -> (sp, ...): chunk i goes to rank i, chunk j of the result came from rank j. Its own transpose, so
    backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # (of a permuted view empty_like keeps its strides: the exchange writes rows)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def sequence_to_heads(x: torch.Tensor, sp: int, group) -> torch.Tensor:
    """(B, N, T/sp, D) this rank's tokens of every head -> (B, N/sp, T, D) every token of this rank's heads."""
    b, n, t_local, d = x.shape
    chunks = x.reshape(b, sp, n // sp, t_local, d).permute(1, 0, 2, 3, 4)  # (sp, B, N/sp, T/sp, D) by head group
    got = _AllToAll.apply(chunks, group)  # (sp, B, N/sp, T/sp, D) by sequence shard
    return got.permute(1, 2, 0, 3, 4).reshape(b, n // sp, sp * t_local, d)


def heads_to_sequence(x: torch.Tensor, sp: int, group) -> torch.Tensor:
    """(B, T, H/sp, D) attention output of this rank's heads -> (B, T/sp, H, D) this rank's tokens of every head."""
    b, t, h_local, d = x.shape
    chunks = x.reshape(b, sp, t // sp, h_local, d).permute(1, 0, 2, 3, 4)  # (sp, B, T/sp, H/sp, D) by shard
    got = _AllToAll.apply(chunks, group)  # (sp, B, T/sp, H/sp, D) by head group
    return got.permute(1, 2, 0, 3, 4).reshape(b, t // sp, sp * h_local, d)


def replicate_kv(x: torch.Tensor, sp: int) -> torch.Tensor:
    """(B, KV, T/sp, D) with KV < sp (KV divides sp) -> (B, sp, T/sp, D): kv-head j serves query heads
    [j·H/KV, (j+1)·H/KV), which after the exchange live on sp ranks [j·sp/KV, (j+1)·sp/KV)."""
    kv = x.shape[1]
    return x if kv % sp == 0 else x.repeat_interleave(sp // kv, dim=1)


class _LocalGroups:
    """The attention module as the inner kernel sees it after the exchange: its own attributes, but as many query
    heads per kv-head as this rank holds (differs from the module's when kv-heads were replicated)."""

    def __init__(self, module: torch.nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def ulysses_attention(inner: str, sp: int, group) -> str:
    """Register attention `inner` (a name in transformers' AttentionInterface) behind the Ulysses exchange over
    `group` (sp ranks), under a name of its own; returns that name, for `attn_implementation`. The name contains
    "sdpa": transformers checks the model class's sdpa support for it (the inner attention is sdpa_segments)."""
    register_segment_attention()  # llmtrain's own attentions are registered when a model loads: not yet here
    kernel = AttentionInterface._global_mapping[inner]
    name = f"ulysses{next(_names)}_sp{sp}_{inner}"

    def attention(module, query, key, value, attention_mask, **kwargs):
        # query (B, H, T/sp, D), key/value (B, KV, T/sp, D): local heads under tp
        q = sequence_to_heads(query, sp, group)  # (B, H/sp, T, D)
        k = sequence_to_heads(replicate_kv(key, sp), sp, group)  # (B, max(KV/sp, 1), T, D)
        v = sequence_to_heads(replicate_kv(value, sp), sp, group)
        local = _LocalGroups(module, q.shape[1] // k.shape[1])
        out, weights = kernel(local, q, k, v, attention_mask, **kwargs)  # (B, T, H/sp, D)
        return heads_to_sequence(out, sp, group), weights  # (B, T/sp, H, D)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[inner])
    return name
