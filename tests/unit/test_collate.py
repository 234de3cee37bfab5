"""Collate: padding, the padding mask, the attention inputs of packed rows, and the Batch helpers."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from llmtrain.data.collate import collate
from llmtrain.data.packing import merge_packed
from llmtrain.losses.lm import IGNORE_INDEX, lm_loss_sum
from llmtrain.models.attention import register_segment_attention

PAD = 0
X = IGNORE_INDEX


def sample(ids: list[int], labels: list[int] | None = None) -> dict:
    return {"input_ids": ids, "labels": list(ids) if labels is None else labels}


def test_unpacked_rows_are_right_padded_with_a_padding_mask():
    batch = collate([sample([5, 6, 7]), sample([8, 9, 10, 11, 12], [X, X, 10, 11, 12]), sample([13])], PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, PAD, PAD], [8, 9, 10, 11, 12], [13, PAD, PAD, PAD, PAD]]
    assert batch.labels.tolist() == [[5, 6, 7, X, X], [X, X, 10, 11, 12], [13, X, X, X, X]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert batch.attention_mask.dtype == torch.long and batch.position_ids is None
    assert batch.num_targets == 2 + 3 + 0  # shifted: label 0 of each row never counts
    assert set(batch.model_inputs()) == {"input_ids", "attention_mask"}
    assert batch.for_attention("flash_attention_2") is batch and batch.for_attention("eager") is batch
    assert set(batch.for_attention("sdpa_segments").model_inputs()) == {"input_ids"}  # causal: pads come last
    assert set(batch.for_attention("flex_segments").model_inputs()) == {"input_ids"}


def test_pad_to_multiple_of_rounds_the_width_up():
    batch = collate([sample([5, 6, 7, 8, 9])], PAD, pad_to_multiple_of=4)
    assert batch.input_ids.shape == (1, 8)
    assert batch.labels[0, 5:].tolist() == [X, X, X]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]


def test_packed_rows_get_a_float_block_causal_mask():
    packed = merge_packed([sample([5, 6]), sample([7, 8, 9])])
    batch = collate([packed, merge_packed([sample([1, 2, 3, 4, 5, 6])])], PAD,
                    pad_to_multiple_of=7).for_attention("sdpa")
    mask = batch.attention_mask
    assert mask.shape == (2, 1, 7, 7) and mask.dtype == torch.float32
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    allowed_first_row = [  # samples [0, 2) and [2, 5); padding at 5 and 6 sees only itself
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ]
    assert (mask[0, 0] == 0).long().tolist() == allowed_first_row
    assert (mask[1, 0, :6, :6] == 0).long().tolist() == torch.ones(6, 6).tril().long().tolist()
    assert batch.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 0]]
    assert batch.labels.tolist() == [[X, 6, X, 8, 9, X, X], [X, 2, 3, 4, 5, 6, X]]
    assert set(batch.model_inputs()) == {"input_ids", "attention_mask", "position_ids"}


def test_an_unpacked_example_in_a_packed_batch_is_one_sample():
    batch = collate([merge_packed([sample([5]), sample([6, 7])]), sample([1, 2, 3])], PAD).for_attention("sdpa")
    assert (batch.attention_mask[1, 0] == 0).long().tolist() == torch.ones(3, 3).tril().long().tolist()
    assert batch.position_ids[1].tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mask_cast_to_a_compute_dtype_stays_finite(dtype):
    batch = collate([merge_packed([sample([5, 6]), sample([7])])], PAD).for_attention("sdpa", dtype)
    assert batch.attention_mask.dtype == dtype
    assert torch.isfinite(batch.attention_mask).all()
    expected = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 0]], dtype=torch.bool)
    assert torch.equal(batch.attention_mask[0, 0] == torch.finfo(dtype).min, expected)


def test_packed_rows_carry_their_segments_for_the_attention_that_needs_no_mask():
    batch = collate([merge_packed([sample([5, 6]), sample([7, 8, 9])]), merge_packed([sample([1, 2, 3, 4, 5, 6])])],
                    PAD, pad_to_multiple_of=7)
    assert batch.attention_mask is None and batch.seq_lens == ((2, 3), (6,))
    with pytest.raises(ValueError, match="for_attention"):  # no silent cross-sample attention
        batch.model_inputs()
    segments = batch.for_attention("sdpa_segments").model_inputs()
    assert segments["segment_lengths"] == ((2, 3, 2), (6, 1)) and "attention_mask" not in segments
    varlen = batch.for_attention("flash_attention_2").model_inputs()
    assert varlen["cu_seq_lens_q"].tolist() == [0, 2, 5, 7, 13, 14] and varlen["cu_seq_lens_q"].dtype == torch.int32
    assert varlen["max_length_q"] == 6 and "attention_mask" not in varlen
    # transformers derives the same boundaries from position ids (restarting at 0 per segment) of one flat row
    flat_positions = torch.tensor([[0, 1, 0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 0]])
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(flat_positions)
    assert cu_q.tolist() == varlen["cu_seq_lens_q"].tolist() and int(max_q) == 6


def test_to_moves_every_tensor():
    batch = collate([merge_packed([sample([5, 6]), sample([7])])], PAD)
    for attention in ("sdpa", "flash_attention_2"):
        moved = batch.for_attention(attention).to("meta")
        tensors = [moved.input_ids, moved.labels, moved.attention_mask, moved.position_ids,
                   *moved.attention_kwargs.values()]
        assert {t.device.type for t in tensors if isinstance(t, torch.Tensor)} == {"meta"}


@pytest.mark.parametrize("attn_implementation", ["sdpa_segments", "sdpa", "eager"])
def test_packed_rows_with_padding_give_finite_logits_and_match_unpadded(attn_implementation, tiny_llama):
    register_segment_attention()
    model = tiny_llama(attn_implementation=attn_implementation, max_position_embeddings=256).eval()
    short = merge_packed([sample([3, 4, 5]), sample([6, 7])])  # 5 tokens, padded to 11
    long = merge_packed([sample(list(range(10, 16))), sample(list(range(20, 25)))])  # 11 tokens
    with torch.no_grad():
        batch = collate([short, long], PAD).for_attention(attn_implementation)
        logits = model(**batch.model_inputs()).logits  # (2, 11, V)
        # each row alone, unpadded: (1, 5, V) and (1, 11, V)
        alone = [model(**collate([row], PAD).for_attention(attn_implementation).model_inputs()).logits
                 for row in (short, long)]
    assert torch.isfinite(logits).all()
    assert torch.isfinite(lm_loss_sum(logits, batch.labels))
    assert [a.shape[1] for a in alone] == [5, 11]
    for row, row_alone in enumerate(alone):  # every row's real tokens, the padded short one and the full long one
        torch.testing.assert_close(logits[row, :row_alone.shape[1]], row_alone[0], atol=1e-5, rtol=0)


def test_unpacked_right_padded_rows_need_no_mask_under_causal_attention(tiny_llama_config):
    register_segment_attention()
    config = tiny_llama_config(max_position_embeddings=256)
    torch.manual_seed(0)
    masked_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    segments_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa_segments").eval()
    segments_model.load_state_dict(masked_model.state_dict())
    batch = collate([sample([5, 6, 7]), sample(list(range(20, 29))), sample([13, 14])], PAD)
    with torch.no_grad():
        masked = masked_model(**batch.model_inputs()).logits  # (3, 9, V), padding mask
        unmasked = segments_model(**batch.for_attention("sdpa_segments").model_inputs()).logits
    real = batch.attention_mask.bool()  # (3, 9)
    assert torch.allclose(masked[real], unmasked[real], atol=1e-5, rtol=0)
    assert torch.allclose(lm_loss_sum(masked, batch.labels), lm_loss_sum(unmasked, batch.labels), atol=1e-5, rtol=0)
