"""Attention without a dense mask: causal attention per packed sample, for sdpa.

A dense (B, 1, T, T) block mask keeps `scaled_dot_product_attention` off its causal kernels: it computes
every (query, key) pair of the row, other samples' and the upper triangle included, and the mask itself
is B·T²·4 bytes. `sdpa_segments` instead runs causal sdpa once per sample of a packed row (the sample
lengths travel with the batch as host ints, so nothing waits on the device), and once for a whole
unpacked batch: right padding comes after every real token, so under a causal mask no real token can
see a pad, and pad positions carry no loss.

Registered with transformers' AttentionInterface, so every family whose attention goes through
`ALL_ATTENTION_FUNCTIONS` (Llama, Qwen2, Mistral, GPT-2, ...) runs it on its (local, under TP) heads.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SEGMENT_ATTENTION = "sdpa_segments"
SEGMENT_LENGTHS = "segment_lengths"  # the model keyword argument that carries them: per row, sample lengths
# PPO with ppo.packing: sdpa with the padding mask it is given (generation over left-padded prompts), and per-sample
# causal sdpa in a forward that passes segment lengths (the packed experience and update forwards)
PACKABLE_SDPA = "sdpa_packable"


def segment_causal_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, segment_lengths: tuple | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, H, T, D), key/value (B, KV, T, D) -> (B, T, H, D), causal within each segment."""
    kwargs.pop("is_causal", None)
    window = kwargs.pop("sliding_window", None)  # sliding layers (Mistral, Qwen2/3, Gemma-3) pass theirs
    if segment_lengths is None:
        mask = window_mask(query.shape[2], window, query.device)
        return sdpa_attention_forward(module, query, key, value, mask, is_causal=mask is None, **kwargs)
    rows = []
    for b, lengths in enumerate(segment_lengths):
        parts, start = [], 0
        for length in lengths:
            end = start + length
            mask = window_mask(length, window, query.device)
            part, _ = sdpa_attention_forward(module, query[b:b + 1, :, start:end], key[b:b + 1, :, start:end],
                                             value[b:b + 1, :, start:end], mask, is_causal=mask is None, **kwargs)
            parts.append(part)  # (1, length, H, D)
            start = end
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0), None


def window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """(1, 1, L, L) bool, True where query i sees key j: i - window < j <= i (transformers' sliding window); None
    where the plain causal kernel is the same (no window, or a sequence no longer than it)."""
    if window is None or length <= window:
        return None
    positions = torch.arange(length, device=device)
    offset = positions[:, None] - positions[None, :]  # (L, L): i - j
    return ((offset >= 0) & (offset < window))[None, None]


def _no_dense_mask(*args, **kwargs) -> None:
    return None


def packable_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, segment_lengths: tuple | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa (its mask: left padding, sliding windows) unless `segment_lengths` are given: then causal
    attention within each packed sample, all samples of a row in one sdpa call (`repadded_causal_sdpa`); the
    placeholder mask of a packed forward (PACKED_ROW_MASK) is not read."""
    if segment_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    window = kwargs.pop("sliding_window", None)
    rows = [repadded_causal_sdpa(module, query[b:b + 1], key[b:b + 1], value[b:b + 1], tuple(lengths), window,
                                 **kwargs) for b, lengths in enumerate(segment_lengths)]
    return torch.cat(rows, dim=0), None


def repadded_causal_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         lengths: tuple[int, ...], window: int | None, **kwargs) -> torch.Tensor:
    """query (1, H, N, D), key/value (1, KV, N, D) of one packed row of samples of `lengths` -> (1, N, H, D). The
    samples are laid out as right-padded rows (S, L) and run through one causal sdpa call: a pad comes after every
    real token of its row, so no real query sees one, and the pads' outputs are dropped. Cheaper on the CPU than one
    sdpa call per sample, and the same attention."""
    index, real = repad_index(lengths, query.device)  # (S, L) positions in the row, (S, L) bool

    def rows(x: torch.Tensor) -> torch.Tensor:  # (1, H, N, D) -> (S, H, L, D)
        return x[0][:, index].transpose(0, 1)

    mask = window_mask(index.shape[1], window, query.device)
    out, _ = sdpa_attention_forward(module, rows(query), rows(key), rows(value), mask, is_causal=mask is None,
                                    **kwargs)  # (S, L, H, D)
    return out[real][None]


@functools.lru_cache(maxsize=16)
def repad_index(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, L) index of each sample's tokens in the packed row (0 on padding) and (S, L) bool: a real token there."""
    longest = max(lengths)
    sizes = torch.tensor(lengths, device=device)  # (S,)
    offsets = torch.arange(longest, device=device)  # (L,)
    real = offsets[None, :] < sizes[:, None]  # (S, L)
    starts = sizes.cumsum(0) - sizes  # (S,)
    return torch.where(real, starts[:, None] + offsets[None, :], 0), real


def register_packable_sdpa() -> None:
    """Make `attn_implementation="sdpa_packable"` known to transformers, with sdpa's own masks (idempotent)."""
    AttentionInterface.register(PACKABLE_SDPA, packable_sdpa)
    AttentionMaskInterface.register(PACKABLE_SDPA, sdpa_mask)


def register_segment_attention() -> None:
    """Make `attn_implementation="sdpa_segments"` known to transformers (idempotent)."""
    AttentionInterface.register(SEGMENT_ATTENTION, segment_causal_sdpa)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, _no_dense_mask)


def row_segments(seq_lens: list[int], width: int) -> tuple[int, ...]:
    """A packed row's samples, then its padding tail as one more segment: they cover all `width` positions."""
    tail = width - sum(seq_lens)
    return tuple(seq_lens) + ((tail,) if tail else ())
