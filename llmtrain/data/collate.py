"""Examples -> a right-padded `Batch` with the attention mask the rows need.

Unpacked rows get the usual (B, T) padding mask. Packed rows (examples with `position_ids`) get a
(B, 1, T, T) block-diagonal causal mask, as FLOAT (0 = attend, finfo(dtype).min = masked): in
transformers 5 a bool 4-D mask is silently wrong with the `eager` attention, a float one is right
with both `eager` and `sdpa`. Padding positions of a packed row attend only to themselves, so no
mask row is fully masked (softmax over nothing gives NaN).
"""

from dataclasses import dataclass, replace

import torch

from llmtrain.losses.lm import IGNORE_INDEX, count_target_tokens


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    labels: torch.Tensor  # (B, T) long, aligned with input_ids, IGNORE_INDEX where no loss
    attention_mask: torch.Tensor | None  # (B, T) long padding mask, (B, 1, T, T) float when packed,
    # or None for packed rows under flash-attention varlen (position_ids alone delimit the samples)
    position_ids: torch.Tensor | None = None  # (B, T) long, restarting per sample; packed rows only

    @property
    def is_packed(self) -> bool:
        return self.position_ids is not None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device, non_blocking=non_blocking)

        return Batch(move(self.input_ids), move(self.labels), move(self.attention_mask),
                     move(self.position_ids))

    def for_varlen_attention(self) -> "Batch":
        """Packed rows for flash-attention varlen: no dense mask, samples found from position_ids."""
        return replace(self, attention_mask=None) if self.is_packed else self

    def num_target_tokens(self) -> torch.Tensor:
        """Tokens that carry a loss after the one-token shift (a 0-d long tensor)."""
        return count_target_tokens(self.labels)

    def model_inputs(self) -> dict:
        """Keyword arguments for `model(**...)`; labels stay out (the loss is `lm_loss_sum`)."""
        inputs = {"input_ids": self.input_ids}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs

    def with_mask_dtype(self, dtype: torch.dtype) -> "Batch":
        """The same batch with a packed mask in the model's compute dtype (sdpa wants them equal).

        Rebuilt rather than cast: finfo(float32).min cast to float16 overflows to -inf.
        """
        if not self.is_packed or self.attention_mask is None or self.attention_mask.dtype == dtype:
            return self
        return replace(self, attention_mask=float_mask(self.attention_mask < 0, dtype))


def collate(
    examples: list[dict],
    pad_token_id: int,
    mask_dtype: torch.dtype = torch.float32,
    pad_to_multiple_of: int | None = None,
) -> Batch:
    """Right-pad examples to the longest row (rounded up to pad_to_multiple_of); labels pad with -100."""
    lengths = [len(example["input_ids"]) for example in examples]
    width = _padded_width(max(lengths), pad_to_multiple_of)
    input_ids = _pad_rows([e["input_ids"] for e in examples], width, pad_token_id)  # (B, T)
    labels = _pad_rows([e["labels"] for e in examples], width, IGNORE_INDEX)  # (B, T)
    if not any("position_ids" in example for example in examples):
        attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T)
        return Batch(input_ids, labels, attention_mask)
    # An unpacked example in a packed batch is a pack of one sample.
    seq_lens = [
        example["seq_lens"] if "position_ids" in example else [length]
        for example, length in zip(examples, lengths)
    ]
    position_ids = _pad_rows(
        [example.get("position_ids", range(length)) for example, length in zip(examples, lengths)],
        width, 0,
    )  # (B, T)
    return Batch(input_ids, labels, block_causal_mask(seq_lens, width, mask_dtype), position_ids)


def block_causal_mask(seq_lens: list[list[int]], width: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, T) float mask: token i sees token j iff j <= i and both lie in the same sample."""
    segments = torch.stack([_segment_ids(lens, width) for lens in seq_lens])  # (B, T)
    same_segment = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # (T, T)
    allowed = same_segment & causal
    return float_mask(~allowed[:, None, :, :], dtype)


def float_mask(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, the dtype's most negative finite value where `masked`."""
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill(
        masked, torch.finfo(dtype).min
    )


def _segment_ids(seq_lens: list[int], width: int) -> torch.Tensor:
    """(T,) sample index of each position; each padding position is a segment of its own."""
    used = sum(seq_lens)
    if used > width:
        raise ValueError(f"seq_lens {seq_lens} sum to {used} > row width {width}")
    samples = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens, dtype=torch.long))
    padding = len(seq_lens) + torch.arange(width - used)
    return torch.cat([samples, padding])


def _pad_rows(rows: list, width: int, value: int) -> torch.Tensor:
    padded = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    return padded


def _padded_width(longest: int, multiple: int | None) -> int:
    if not multiple:
        return longest
    return -(-longest // multiple) * multiple
