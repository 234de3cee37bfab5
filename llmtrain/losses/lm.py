"""Causal-LM losses as pure tensor functions.

Labels arrive aligned with input_ids (label t is token t, or IGNORE_INDEX where no loss applies);
the one-token shift happens here and nowhere else. Losses are returned as *sums* with the number of
target tokens, so the trainer can normalise by the target tokens of the whole global batch
(all micro-batches, all ranks) rather than averaging per-micro-batch means.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T-1) targets: position t predicts token t+1."""
    return labels[:, 1:]


def count_target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of tokens that carry a loss in a (B, T) label tensor (a 0-d long tensor)."""
    return (shifted_targets(labels) != IGNORE_INDEX).sum()


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over target tokens.

    logits: (B, T, V); labels: (B, T). A batch with no target token gives 0 with zero gradient.
    """
    targets = shifted_targets(labels)  # (B, T-1)
    predictions = logits[:, :-1, :]  # (B, T-1, V)
    return F.cross_entropy(
        predictions.reshape(-1, predictions.size(-1)).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def lm_correct_count(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Target tokens whose argmax prediction is right (teacher-forced token accuracy numerator)."""
    targets = shifted_targets(labels)  # (B, T-1)
    predicted = logits[:, :-1, :].argmax(dim=-1)  # (B, T-1)
    return ((predicted == targets) & (targets != IGNORE_INDEX)).sum()
