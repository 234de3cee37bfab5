"""Examples -> a right-padded `Batch`, and the attention inputs each attention implementation needs.

Unpacked rows carry the usual (B, T) padding mask. Packed rows (examples with `position_ids`) carry
their sample lengths as host ints; `for_attention` turns them into what the model's attention reads:
- `sdpa_segments` (llmtrain's default off flash-attention): no mask at all, the per-row segment lengths
  as a keyword argument (see models/attention.py);
- flash-attention: no mask, `cu_seq_lens_*` over the flattened (B·T) tokens for the varlen kernel
  (transformers infers them from position_ids only for a batch of one row);
- FlexAttention (`flex_segments`, and transformers' `flex_attention`): a document BlockMask as the
  `attention_mask`, built once per batch here from the sample lengths (see models/flex.py); unpacked
  `flex_segments` batches get no mask, as with `sdpa_segments`;
- any other (`sdpa`, `eager`): a (B, 1, T, T) block-diagonal causal mask, as FLOAT (0 = attend,
  finfo(dtype).min = masked): in transformers 5 a bool 4-D mask is silently wrong with `eager`. Padding
  positions attend only to themselves, so no mask row is fully masked (softmax over nothing is NaN).
"""

from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

from llmtrain.losses.lm import IGNORE_INDEX, count_target_tokens
from llmtrain.models.attention import SEGMENT_ATTENTION, SEGMENT_LENGTHS, row_segments
from llmtrain.models.flex import FLEX_ATTENTION, FLEX_IMPLEMENTATIONS, BlockMask, document_block_mask


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    labels: torch.Tensor  # (B, T) long, aligned with input_ids, IGNORE_INDEX where no loss
    attention_mask: torch.Tensor | BlockMask | None  # (B, T) long padding mask; packed: (B, 1, T, T) float,
    # a BlockMask or None (see for_attention)
    position_ids: torch.Tensor | None = None  # (B, T) long, restarting per sample; packed rows only
    seq_lens: tuple[tuple[int, ...], ...] | None = None  # packed rows: each row's sample lengths
    num_targets: int = 0  # tokens that carry a loss after the one-token shift, counted on the host
    attention_kwargs: dict = field(default_factory=dict)  # extra model keyword arguments for the attention
    row_lengths: tuple[int, ...] = ()  # real (non-padding) tokens per row, on the host: what MoE routers count
    # labels are already the targets (position t: label of token t + 1): a sequence shard's, shifted before the cut
    # (data/sequence_shard.py)
    shifted: bool = False

    @property
    def is_packed(self) -> bool:
        return self.position_ids is not None

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        def move(value):
            if isinstance(value, BlockMask):
                return value.to(device)
            return value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value

        return replace(self, input_ids=move(self.input_ids), labels=move(self.labels),
                       attention_mask=move(self.attention_mask), position_ids=move(self.position_ids),
                       attention_kwargs={key: move(value) for key, value in self.attention_kwargs.items()})

    def for_attention(self, attn_implementation: str, mask_dtype: torch.dtype = torch.float32) -> "Batch":
        """This batch with the attention inputs `attn_implementation` reads (built on the batch's device)."""
        if attn_implementation == SEGMENT_ATTENTION:
            segments = {SEGMENT_LENGTHS: self._row_segments()} if self.is_packed else {}
            return replace(self, attention_mask=None, attention_kwargs=segments)
        if attn_implementation == FLEX_ATTENTION and not self.is_packed:
            return replace(self, attention_mask=None)
        if not self.is_packed:
            return self
        if attn_implementation in FLEX_IMPLEMENTATIONS:
            segment_ids = torch.stack([_segment_ids(lens, self.width) for lens in self.seq_lens])  # (B, T), host
            return replace(self, attention_mask=document_block_mask(segment_ids, self.input_ids.device))
        if attn_implementation.startswith("flash_attention"):
            return replace(self, attention_mask=None, attention_kwargs=self._varlen_kwargs())
        mask = block_causal_mask(self.seq_lens, self.width, mask_dtype, self.input_ids.device)
        return replace(self, attention_mask=mask)

    def targets(self) -> torch.Tensor:
        """(B, T) the target of each position (label t + 1; IGNORE_INDEX at the row's end and where no loss)."""
        if self.shifted:
            return self.labels
        return torch.nn.functional.pad(self.labels[:, 1:], (0, 1), value=IGNORE_INDEX)

    def token_mask(self) -> torch.Tensor:
        """(B, T) float: 1 on real tokens, 0 on padding (whatever the attention's mask); the MoE router loss's mask."""
        lengths = torch.tensor(self.row_lengths, device=self.input_ids.device)  # (B,)
        return (torch.arange(self.width, device=self.input_ids.device)[None, :] < lengths[:, None]).float()

    def model_inputs(self) -> dict:
        """Keyword arguments for `model(**...)`; labels stay out (the loss is `lm_loss_sum`)."""
        if self.is_packed and self.attention_mask is None and not self.attention_kwargs:
            raise ValueError("a packed batch needs `for_attention(...)` first: without a mask or segment "
                             "lengths its samples would attend to each other")
        inputs = {"input_ids": self.input_ids, **self.attention_kwargs}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs

    def _row_segments(self) -> tuple[tuple[int, ...], ...]:
        return tuple(row_segments(lens, self.width) for lens in self.seq_lens)

    def _varlen_kwargs(self) -> dict:
        """Flash-attention varlen over the flattened rows: every sample, and each row's padding tail."""
        lengths = [length for row in self._row_segments() for length in row]
        cu_seq_lens = torch.tensor(list(accumulate(lengths, initial=0)), dtype=torch.int32,
                                   device=self.input_ids.device)  # (segments + 1,)
        longest = max(lengths)
        return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
                "max_length_q": longest, "max_length_k": longest}


FILLER = "__filler__"  # an eval example that only keeps a rank in step with the others: no loss, no count


def collate(examples: list[dict], pad_token_id: int, pad_to_multiple_of: int | None = None) -> Batch:
    """Right-pad examples to the longest row (rounded up to pad_to_multiple_of); labels pad with -100.
    A FILLER example keeps its tokens and loses its targets."""
    lengths = [len(example["input_ids"]) for example in examples]
    width = _padded_width(max(lengths), pad_to_multiple_of)
    input_ids = _pad_rows([e["input_ids"] for e in examples], width, pad_token_id)  # (B, T)
    labels = _pad_rows([[IGNORE_INDEX] * len(e["labels"]) if e.get(FILLER) else e["labels"] for e in examples],
                       width, IGNORE_INDEX)  # (B, T)
    num_targets = int(count_target_tokens(labels))
    if not any("position_ids" in example for example in examples):
        attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T)
        return Batch(input_ids, labels, attention_mask, num_targets=num_targets, row_lengths=tuple(lengths))
    # An unpacked example in a packed batch is a pack of one sample.
    seq_lens = tuple(tuple(example["seq_lens"]) if "position_ids" in example else (length,)
                     for example, length in zip(examples, lengths))
    position_ids = _pad_rows(
        [example.get("position_ids", range(length)) for example, length in zip(examples, lengths)],
        width, 0,
    )  # (B, T)
    return Batch(input_ids, labels, None, position_ids, seq_lens, num_targets, row_lengths=tuple(lengths))


def block_causal_mask(seq_lens, width: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, 1, T, T) float mask: token i sees token j iff j <= i and both lie in the same sample."""
    segments = torch.stack([_segment_ids(lens, width) for lens in seq_lens]).to(device)  # (B, T)
    same_segment = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (T, T)
    allowed = same_segment & causal
    return float_mask(~allowed[:, None, :, :], dtype)


def float_mask(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, the dtype's most negative finite value where `masked`."""
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill(
        masked, torch.finfo(dtype).min
    )


def _segment_ids(seq_lens, width: int) -> torch.Tensor:
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
