"""Pairs under pipeline parallelism without torchrun: a PairBatch padded to the stage buffers' (rows, width) keeps
every sequence's tokens, ends and log-probs; the buffers' shapes per layout; a reward model (sequence classifier)
split into stages keeps its keys and gives its scores."""

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from llmtrain.backends.pipeline import head_name, micro_batch_shape, pad_micro_batch, stage_copy
from llmtrain.losses.dpo import sequence_sums
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.stages.preference import collate_pairs


def pair(prompt, chosen, rejected):
    """A preference example: the prompt's labels ignored, the responses' kept."""
    def side(response):
        return {"input_ids": prompt + response, "labels": [IGNORE_INDEX] * len(prompt) + response}
    c, r = side(chosen), side(rejected)
    return {"chosen_input_ids": c["input_ids"], "chosen_labels": c["labels"],
            "rejected_input_ids": r["input_ids"], "rejected_labels": r["labels"]}


EXAMPLES = [pair([5, 6], [7, 8, 9], [10]), pair([11, 12, 13], [14], [15, 16, 17, 18])]


def fake_logps(batch):
    """(R, T) a value per position from its token, row and column: a token moved by the padding changes the sum."""
    rows = batch.rows.input_ids
    return rows.float() * 10 + torch.arange(rows.shape[0])[:, None] + torch.arange(rows.shape[1]) * 0.01


def test_padded_pairs_keep_their_tokens_ends_and_sums():
    for padding_free in (False, True):
        batch = collate_pairs(EXAMPLES, pad_token_id=0, padding_free=padding_free)
        rows, width = micro_batch_shape(batch, seq_len=9, count=3)  # buffers for 3 pairs, this batch holds 2
        assert (rows, width) == ((1, 54) if padding_free else (6, 9))
        padded = pad_micro_batch(batch, rows, width, "sdpa", torch.float32)
        assert tuple(padded.rows.input_ids.shape) == (rows, width) and padded.ends.shape == (4,)
        flat, padded_flat = batch.rows.input_ids.flatten(), padded.rows.input_ids.flatten()
        assert torch.equal(padded_flat[padded.ends], flat[batch.ends])  # each sequence's last token (its EOS)
        assert torch.equal(padded_flat[padded.ends], torch.tensor([9, 14, 10, 18]))
        assert padded.sequence_ids.shape == (rows, width) and int((padded.sequence_ids >= 0).sum()) == 19
        ours = sequence_sums(fake_logps(padded), padded.rows.labels, padded.sequence_ids, 4, False)  # (2P,)
        theirs = sequence_sums(fake_logps(batch), batch.rows.labels, batch.sequence_ids, 4, False)
        assert torch.equal(ours, theirs) and ours.abs().sum() > 0
        assert padded.keys == batch.keys and torch.equal(padded.weight, batch.weight)


def test_buffers_for_the_first_eval_batch_hold_its_pairs():
    batch = collate_pairs(EXAMPLES, pad_token_id=0)
    assert micro_batch_shape(batch, seq_len=16) == (4, 16)  # count None: the batch's own 2 pairs
    assert micro_batch_shape(batch.rows, seq_len=16) == (4, 16)  # a plain Batch: its rows
    assert micro_batch_shape(batch.rows, seq_len=16, count=2) == (2, 16)


def tiny_reward_model():
    torch.manual_seed(0)
    arch = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_key_value_heads=2, num_hidden_layers=4, vocab_size=50, num_labels=1,
                                pad_token_id=0, tie_word_embeddings=False)
    return AutoModelForSequenceClassification.from_config(arch, attn_implementation="sdpa").eval()


def test_a_reward_model_splits_at_its_score_head():
    model = tiny_reward_model()
    assert head_name(model) == "score"
    first, last = (stage_copy(model, b, i == 0, i == 1) for i, b in enumerate([range(0, 2), range(2, 4)]))
    assert sorted([*first.state_dict(), *last.state_dict()]) == sorted(model.state_dict())
    assert first.score is None and last.model.embed_tokens is None
    ids = torch.randint(1, 50, (2, 7))  # (B, T)
    with torch.no_grad():
        hidden = first.model(input_ids=ids).last_hidden_state  # (B, T, h)
        scores = last(inputs_embeds=hidden).logits  # (B, 1): transformers pools the last position without ids
        torch.testing.assert_close(scores, model(input_ids=ids).logits, rtol=0, atol=1e-6)
