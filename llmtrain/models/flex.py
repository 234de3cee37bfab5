"""Packed rows in one attention kernel per layer: FlexAttention with a document (block-causal) BlockMask.

`sdpa_segments` launches one sdpa per packed sample per layer from Python; flash-attention's varlen kernel
does a whole batch in one launch but is often not installed. `flex_segments` runs torch's FlexAttention
(`torch.nn.attention.flex_attention`) once per layer over the (B, T) batch with a BlockMask that lets
token i see token j iff j <= i and both lie in the same sample (each padding position is a sample of its
own). The BlockMask is built once per batch, in `Batch.for_attention`, and reaches every layer as the
model's `attention_mask`: transformers' mask builder hands a 4-D BlockMask through unchanged. Built at
block level from the sample lengths (`document_block_mask`): no (T, T) mask is ever materialised, and
`create_block_mask` (which evaluates the mask on every (query, key) pair) is not called.

Unpacked right-padded batches get no mask: causal sdpa, as in sdpa_segments (padding comes after every
real token, and carries no loss).

The kernel: `torch.compile(flex_attention)`, compiled once per process, on CUDA; eager elsewhere (eager
FlexAttention is a reference implementation that materialises the (B, H, T, T) scores: correct, slow).
`LLMTRAIN_FLEX_COMPILE=1` compiles on any device, `=0` never. Under a compiled model (backend.compile) the
plain `flex_attention` is traced into the model's graph instead.

Limits (torch 2.13): FlexAttention has no backward on CPU (torch raises NotImplementedError, eager and
compiled), so on CPU `flex_segments` serves frozen roles and evaluation only; it has no dropout.
transformers' own `attn_implementation="flex_attention"` also takes the BlockMask (see
`Batch.for_attention`), but compiles the kernel on every device, CPU included.
"""

from __future__ import annotations

import os

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

FLEX_ATTENTION = "flex_segments"
FLEX_IMPLEMENTATIONS = (FLEX_ATTENTION, "flex_attention")  # llmtrain's, and transformers' own: both take a BlockMask
BLOCK_SIZE = 128  # torch's default sparse block size (create_block_mask's BLOCK_SIZE); the GPU kernels' tile
COMPILE_ENV = "LLMTRAIN_FLEX_COMPILE"


def document_block_mask(segment_ids: torch.Tensor, device: torch.device | str = "cpu",
                        block_size: int = BLOCK_SIZE) -> BlockMask:
    """The BlockMask of packed rows: position i sees j iff j <= i and both have the same segment id.

    `segment_ids` (B, T), on the host, non-decreasing along each row (samples, then each padding position
    a segment of its own). Equal to `create_block_mask` with the same mask_mod (tested), from (T / block)²
    block comparisons instead of T² mask evaluations: as ids never decrease, a query block and an earlier key
    block share a segment iff the key block's last id is the query block's first, and every pair of them is
    allowed iff both blocks lie in that one segment."""
    ids = segment_ids.to(torch.int32)  # (B, T)
    width = ids.shape[1]
    n = -(-width // block_size)
    blocks = torch.nn.functional.pad(ids, (0, n * block_size - width), mode="replicate").view(len(ids), n, block_size)
    first, last = blocks[:, :, 0], blocks[:, :, -1]  # (B, n): ids are non-decreasing within a row
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)  # (n_q, n_kv): key block strictly before query block
    q_first, k_last = first[:, :, None], last[:, None, :]  # (B, n_q, 1), (B, 1, n_kv)
    one_sample = first == last  # (B, n)
    complete = torch.arange(1, n + 1) * block_size <= width  # (n,): the last block may reach past the row
    full = earlier & (one_sample & complete)[:, :, None] & one_sample[:, None, :] & (k_last == q_first)
    partial = (earlier & (k_last == q_first) & ~full) | torch.eye(n, dtype=torch.bool)  # the diagonal: causal
    ids_on_device = ids.to(device)

    def same_sample_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids_on_device[b, q_idx] == ids_on_device[b, kv_idx])

    mask = BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=block_size,
                                    mask_mod=same_sample_causal, seq_lengths=(width, width))
    return mask.to(device)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n_q, n_kv) bool -> BlockMask's (B, 1, n_q) counts and (B, 1, n_q, n_kv) indices, present blocks first."""
    blocks = blocks[:, None].to(torch.int32)
    indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
    return blocks.sum(-1).to(torch.int32), indices.to(torch.int32)


_compiled = {}


def flex_kernel(device: torch.device):
    """flex_attention, compiled once per process where that is the point (CUDA, or as LLMTRAIN_FLEX_COMPILE says)."""
    if torch.compiler.is_compiling():
        return flex_attention  # already inside a compiled graph: traced with it
    wanted = os.environ.get(COMPILE_ENV)
    if not (device.type == "cuda" if wanted in (None, "") else wanted == "1"):
        return flex_attention
    if "kernel" not in _compiled:
        _compiled["kernel"] = torch.compile(flex_attention)
    return _compiled["kernel"]


def flex_segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: BlockMask | None, scaling: float | None = None, dropout: float = 0.0,
                           softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, H, T, D), key/value (B, KV, T, D) -> (B, T, H, D); one kernel per call with a BlockMask."""
    kwargs.pop("is_causal", None)
    if attention_mask is None:  # unpacked, right-padded: causal is enough
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, scaling=scaling,
                                      dropout=dropout, softcap=softcap, **kwargs)
    if not isinstance(attention_mask, BlockMask):
        raise TypeError(f"{FLEX_ATTENTION} takes a BlockMask from Batch.for_attention, got {type(attention_mask)}")
    if dropout > 0:
        raise ValueError(f"{FLEX_ATTENTION}: FlexAttention has no dropout; set model.dropout=0 or use sdpa_segments")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{FLEX_ATTENTION}: attention sinks (s_aux) are not supported; use sdpa_segments")
    heads = query.shape[1]
    enable_gqa = heads & (heads - 1) == 0  # GQA in the kernel for power-of-two head counts, as transformers does
    if not enable_gqa:  # (local heads under TP need not be one)
        key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)
    out = flex_kernel(query.device)(query, key, value, score_mod=score_mod, block_mask=attention_mask,
                                    scale=scaling, enable_gqa=enable_gqa)  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), None


def _no_dense_mask(*args, **kwargs) -> None:
    return None  # packed batches bring their BlockMask (a 4-D mask skips this); unpacked need none


def register_flex_attention() -> None:
    """Make `attn_implementation="flex_segments"` known to transformers (idempotent)."""
    AttentionInterface.register(FLEX_ATTENTION, flex_segment_attention)
    AttentionMaskInterface.register(FLEX_ATTENTION, _no_dense_mask)
