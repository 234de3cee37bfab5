"""LM loss against a hand computation, zero-target batches, and accumulation = one big batch."""

import math

import torch

from llmtrain.losses.lm import IGNORE_INDEX, count_target_tokens, lm_correct_count, lm_loss_sum
from tests import helpers


def test_loss_sum_matches_hand_computation():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]])  # (1, 3, 3)
    labels = torch.tensor([[IGNORE_INDEX, 1, 0]])  # position 0 predicts token 1, position 1 predicts token 0
    expected = -math.log(math.exp(0) / (math.exp(2) + 2)) - math.log(math.exp(0) / (math.exp(1) + 2))
    assert math.isclose(lm_loss_sum(logits, labels).item(), expected, rel_tol=1e-6)
    assert count_target_tokens(labels).item() == 2
    # position 0 argmax is 0 (label 1: wrong), position 1 argmax is 1 (label 0: wrong)
    assert lm_correct_count(logits, labels).item() == 0
    assert lm_correct_count(logits, torch.tensor([[IGNORE_INDEX, 0, 1]])).item() == 2


def test_zero_target_batch_is_finite_with_zero_gradient():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.full((2, 5), IGNORE_INDEX)
    loss_sum = lm_loss_sum(logits, labels)
    normalised = loss_sum / max(int(count_target_tokens(labels)), 1)
    normalised.backward()
    assert torch.isfinite(normalised) and normalised.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0


def tiny_llama():
    return helpers.tiny_llama(vocab_size=50, hidden_size=32, intermediate_size=64, max_position_embeddings=64).float()


def samples_of_different_lengths():
    generator = torch.Generator().manual_seed(1)
    rows = []
    for length, prompt in [(5, 2), (17, 6), (9, 3), (30, 10)]:
        ids = torch.randint(0, 50, (length,), generator=generator)
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        rows.append((ids, labels))
    return rows


def pad(rows):
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, :len(ids)], labels[i, :len(ids)], mask[i, :len(ids)] = ids, lab, 1
    return input_ids, labels, mask


def loss_and_grads(model, micro_batches):
    """The trainer's rule: sum of per-token losses over all micro-batches / global target count."""
    model.zero_grad()
    total_targets = sum(int(count_target_tokens(pad(mb)[1])) for mb in micro_batches)
    total = 0.0
    for mb in micro_batches:
        input_ids, labels, mask = pad(mb)
        loss = lm_loss_sum(model(input_ids=input_ids, attention_mask=mask).logits, labels) / total_targets
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_grad_accumulation_4x1_equals_one_batch_of_4():
    model, rows = tiny_llama(), samples_of_different_lengths()
    loss_accum, grads_accum = loss_and_grads(model, [[row] for row in rows])
    loss_full, grads_full = loss_and_grads(model, [rows])
    assert math.isclose(loss_accum, loss_full, rel_tol=1e-6)
    for name in grads_full:
        torch.testing.assert_close(grads_accum[name], grads_full[name], rtol=1e-6, atol=1e-7, msg=name)
    # and it is not a mean of per-micro-batch means, which weights short samples more:
    per_batch_means = []
    for row in rows:
        input_ids, labels, mask = pad([row])
        per_batch_means.append(lm_loss_sum(model(input_ids=input_ids, attention_mask=mask).logits, labels).item()
                               / int(count_target_tokens(labels)))
    assert abs(sum(per_batch_means) / len(rows) - loss_full) > 1e-4


def test_finished_run_token_losses_sum_to_the_training_loss():
    """llmtrain.finished_run rescores samples token by token (collated as the run's eval, the loss placed on the
    token it predicts): per-token losses sum to lm_loss_sum over the same targets, the first position and padding
    carry none."""
    from llmtrain.data.collate import collate
    from llmtrain.finished_run import per_token_losses
    from llmtrain.losses.lm import lm_loss_sum

    torch.manual_seed(0)
    batch = collate([{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
                     {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}], pad_token_id=0)  # (2, 5)
    targets = batch.labels
    assert (batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
            and targets[1, 3:].tolist() == [-100, -100])
    logits = torch.randn(2, 5, 11)
    per_token = per_token_losses(logits, targets)  # (2, 5)
    assert per_token[:, 0].eq(0).all() and per_token[1, 3:].eq(0).all() and per_token[0, 1] == 0
    torch.testing.assert_close(per_token.sum(), lm_loss_sum(logits, targets), rtol=1e-6, atol=1e-6)
