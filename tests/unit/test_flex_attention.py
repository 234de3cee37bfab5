"""FlexAttention for packed rows: the BlockMask built from sample lengths, and the attention op itself."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from llmtrain.data.collate import _segment_ids, collate
from llmtrain.data.packing import merge_packed
from llmtrain.models.flex import BlockMask, document_block_mask, flex_segment_attention


@pytest.mark.parametrize("seq_lens, width, block", [
    ((5, 3, 9), 20, 4),  # a padding tail, a ragged last block
    ((4, 4, 4, 4), 16, 4),  # samples on block boundaries: full blocks off the diagonal
    ((3, 13, 2), 25, 8),
    ((1, 1, 1), 12, 2),  # mostly padding: one segment per position
    ((100, 50, 120, 30), 310, 128),  # torch's block size
])
def test_document_block_mask_is_create_block_masks(seq_lens, width, block):
    """Block by block (partial and full blocks, both orders) what create_block_mask finds by evaluating the
    mask on every (query, key) pair."""
    ids = torch.stack([_segment_ids(seq_lens, width), _segment_ids(seq_lens[::-1], width)])  # (2, T)
    mask = document_block_mask(ids, "cpu", block)
    expected = create_block_mask(mask.mask_mod, 2, None, width, width, device="cpu", BLOCK_SIZE=block)
    assert mask.shape == expected.shape == (2, 1, width, width)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(mask, name), getattr(expected, name)), name


def test_document_mask_mod_is_causal_within_each_sample():
    ids = _segment_ids((2, 3), 7)[None]  # samples [0, 2), [2, 5); padding 5 and 6 are segments of their own
    mask = document_block_mask(ids, "cpu", block_size=4)
    q, kv = torch.meshgrid(torch.arange(7), torch.arange(7), indexing="ij")
    allowed = mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
    assert allowed.long().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ]


def test_for_attention_gives_flex_a_block_mask_for_packed_rows_and_nothing_for_unpacked():
    packed = collate([merge_packed([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3], "labels": [3]}])], 0)
    inputs = packed.for_attention("flex_segments").model_inputs()
    assert isinstance(inputs["attention_mask"], BlockMask) and inputs["attention_mask"].shape == (1, 1, 3, 3)
    assert isinstance(packed.for_attention("flex_attention").attention_mask, BlockMask)  # transformers' own
    unpacked = collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}], 0)
    assert set(unpacked.for_attention("flex_segments").model_inputs()) == {"input_ids"}  # causal: pads come last


def reference(query, key, value, lengths, scale, softcap=None):
    """Per segment: causal softmax attention written out, GQA by repeating kv heads. -> (1, T, H, D)"""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    parts, start = [], 0
    for length in lengths:
        q, k, v = (x[:, :, start:start + length] for x in (query, key, value))
        scores = q @ k.transpose(-1, -2) * scale  # (1, H, L, L)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
        parts.append((scores.softmax(-1) @ v).transpose(1, 2))
        start += length
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("heads, kv_heads, softcap", [(4, 2, None), (6, 2, None), (4, 4, 5.0)])
def test_flex_segment_attention_is_causal_attention_per_segment(heads, kv_heads, softcap):
    """GQA in the kernel (power-of-two heads) or by repeated kv heads (6, as under TP), and a tanh softcap."""
    torch.manual_seed(0)
    lengths = (5, 9, 3, 7)  # the last one a padding tail: a segment per position in the mask
    query, key, value = torch.randn(1, heads, 24, 8), torch.randn(1, kv_heads, 24, 8), torch.randn(1, kv_heads, 24, 8)
    ids = _segment_ids(lengths[:3], 24)[None]
    out, _ = flex_segment_attention(torch.nn.Module(), query, key, value, document_block_mask(ids, "cpu", 8),
                                    scaling=0.3, softcap=softcap)
    expected = reference(query, key, value, lengths[:3] + (1,) * 7, 0.3, softcap)
    assert out.shape == (1, 24, heads, 8)
    assert torch.allclose(out, expected, atol=1e-5, rtol=0)


def test_flex_segment_attention_refuses_dropout():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="dropout"):
        flex_segment_attention(torch.nn.Module(), x, x, x, document_block_mask(_segment_ids((4,), 4)[None]),
                               dropout=0.1)
