"""Packing: the plan, the merged row, and parity of a packed row with its samples run alone."""

import itertools

import datasets
import pytest
import torch

from llmtrain.data.collate import collate
from llmtrain.data.dataset import build_examples
from llmtrain.data.formats import FORMATS
from llmtrain.data.packing import merge_packed, pack_best_fit
from llmtrain.losses.lm import IGNORE_INDEX, count_target_tokens, lm_loss_sum
from llmtrain.models.attention import register_segment_attention
from llmtrain.models.flex import register_flex_attention
from tests import helpers


def tiny_llama(attn_implementation: str):
    register_segment_attention()
    register_flex_attention()
    return helpers.tiny_llama(attn_implementation=attn_implementation, max_position_embeddings=256).eval()


def test_pack_best_fit_fills_rows_longest_first():
    lengths = [5, 3, 7, 2, 2, 9, 1, 10, 4]  # 43 tokens: 5 rows of 10 is the least possible
    groups = pack_best_fit(lengths, 10)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    # Worked by hand: 10 | 9 | 7 | 5 open rows; 4 joins the 5; 3 joins the 7; 2 opens a row, the other 2
    # joins it; 1 takes the fullest row with room (9). In-order next-fit needs 6 rows here.
    assert groups == [[0, 8], [1, 2], [3, 4], [5, 6], [7]]


def test_pack_best_fit_rejects_a_sample_longer_than_a_row():
    with pytest.raises(ValueError, match="max_seq_len"):
        pack_best_fit([3, 11], 10)


def test_merge_packed_restarts_positions_and_masks_each_first_label():
    merged = merge_packed([
        {"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
        {"input_ids": [4, 5], "labels": [IGNORE_INDEX, 5]},
        {"input_ids": [6, 7], "labels": [6, 7]},
    ])
    assert merged["input_ids"] == [1, 2, 3, 4, 5, 6, 7]
    assert merged["labels"] == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, 7]
    assert merged["position_ids"] == [0, 1, 2, 0, 1, 0, 1]
    assert merged["seq_lens"] == [3, 2, 2]


def test_packed_examples_never_exceed_max_seq_len_and_hold_every_sample_once(tokenizer):
    rows = datasets.Dataset.from_list([{"text": "x" * n} for n in [3, 30, 12, 1, 25, 7, 60, 2, 18]])
    unpacked, _ = build_examples(rows, tokenizer, fmt="text", max_seq_len=40, packing=False)
    packed, _ = build_examples(rows, tokenizer, fmt="text", max_seq_len=40, packing=True)
    assert len(packed) < len(unpacked)
    assert all(len(packed[i]["input_ids"]) <= 40 for i in range(len(packed)))
    assert packed.row_lengths() == [len(packed[i]["input_ids"]) for i in range(len(packed))]
    packed_samples = sorted(tuple(row["input_ids"][start:start + n])
                            for row in map(packed.__getitem__, range(len(packed)))
                            for start, n in zip([0, *itertools.accumulate(row["seq_lens"])], row["seq_lens"]))
    assert packed_samples == sorted(tuple(unpacked[i]["input_ids"]) for i in range(len(unpacked)))


def parity_samples(tokenizer) -> list[dict]:
    rows = [
        ("prompt_response", {"prompt": "reverse: abcdefg\n", "response": "gfedcba"}),
        ("text", {"text": "the robot sees the big moon."}),
        ("prompt_response", {"prompt": "reverse: xy\n", "response": "yx"}),
        ("text", {"text": "a dog hears a bird in the park every day."}),
    ]
    samples = [FORMATS[fmt](row, tokenizer) for fmt, row in rows]
    assert len({len(sample["input_ids"]) for sample in samples}) == len(samples)  # all lengths differ
    return samples


@pytest.mark.parametrize("attn_implementation", ["sdpa_segments", "sdpa", "eager", "flex_segments"])
def test_packed_row_matches_its_samples_run_alone(tokenizer, attn_implementation):
    model = tiny_llama(attn_implementation)
    samples = parity_samples(tokenizer)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in samples]  # (T_i, V)
        loss_sum = sum(lm_loss_sum(logits[None], torch.tensor([s["labels"]])) for logits, s in zip(alone, samples))
        count = sum(count_target_tokens(torch.tensor([s["labels"]])) for s in samples)

        batch = collate([merge_packed(samples)], pad_token_id=tokenizer.eos_token_id).for_attention(attn_implementation)
        packed_logits = model(**batch.model_inputs()).logits  # (1, T, V)
        packed_loss = lm_loss_sum(packed_logits, batch.labels) / batch.num_targets

    assert batch.num_targets == count
    assert torch.allclose(packed_loss, loss_sum / count, atol=1e-5, rtol=0)
    per_sample = packed_logits[0].split([len(s["input_ids"]) for s in samples])
    for packed, single in zip(per_sample, alone):
        assert torch.allclose(packed, single, atol=1e-5, rtol=0)


def test_position_ids_alone_do_not_isolate_packed_samples(tokenizer):
    """Control: without the block mask the second sample sees the first, so parity above is earned."""
    model = tiny_llama("sdpa")
    samples = parity_samples(tokenizer)[:2]
    merged = merge_packed(samples)
    with torch.no_grad():
        second_alone = model(input_ids=torch.tensor([samples[1]["input_ids"]])).logits[0]
        leaky = model(input_ids=torch.tensor([merged["input_ids"]]),
                      position_ids=torch.tensor([merged["position_ids"]])).logits[0]
    second_leaky = leaky[len(samples[0]["input_ids"]):]
    assert not torch.allclose(second_leaky, second_alone, atol=1e-3)


def test_segment_attention_trains_like_the_dense_block_mask(tokenizer):
    """Same loss and gradients from per-sample sdpa as from the (B, 1, T, T) mask, dropout off, 2 padded rows."""
    samples = parity_samples(tokenizer)
    rows = [merge_packed(samples[:2]), merge_packed(samples[2:])]
    grads = {}
    for attention in ("sdpa", "sdpa_segments"):
        model = tiny_llama(attention).train()
        batch = collate(rows, pad_token_id=tokenizer.eos_token_id).for_attention(attention)
        loss = lm_loss_sum(model(**batch.model_inputs()).logits, batch.labels) / batch.num_targets
        loss.backward()
        grads[attention] = (loss.detach(), [p.grad for p in model.parameters()])
    (dense_loss, dense_grads), (segment_loss, segment_grads) = grads["sdpa"], grads["sdpa_segments"]
    assert torch.allclose(dense_loss, segment_loss, atol=1e-6, rtol=0)
    for dense, segment in zip(dense_grads, segment_grads):
        assert torch.allclose(dense, segment, atol=1e-6, rtol=1e-5)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """torch 2.13 refuses FlexAttention's backward on the CPU up front (`_validate_device`), compiled or not;
    its eager (reference, dense) backward runs fine there. Lifting the refusal lets the CPU check that the
    BlockMask and llmtrain's wiring give the right gradients; the GPU's compiled backward kernel is torch's."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda query, key, value: None)


def test_flex_attention_trains_like_segment_attention(tokenizer, flex_backward_on_cpu):
    """One FlexAttention kernel per layer with the batch's BlockMask: the loss and every gradient of sdpa per
    sample, dropout off, 2 packed rows with padding, eager."""
    samples = parity_samples(tokenizer)
    rows = [merge_packed(samples[:3]), merge_packed(samples[3:])]
    grads = {}
    for attention in ("sdpa_segments", "flex_segments"):
        model = tiny_llama(attention).train()
        batch = collate(rows, pad_token_id=tokenizer.eos_token_id).for_attention(attention)
        loss = lm_loss_sum(model(**batch.model_inputs()).logits, batch.labels) / batch.num_targets
        loss.backward()
        grads[attention] = (loss.detach(), [p.grad for p in model.parameters()])
    (segment_loss, segment_grads), (flex_loss, flex_grads) = grads["sdpa_segments"], grads["flex_segments"]
    assert torch.allclose(flex_loss, segment_loss, atol=1e-5, rtol=0)
    for segment, flex in zip(segment_grads, flex_grads):
        assert torch.allclose(flex, segment, atol=1e-5, rtol=1e-5)
