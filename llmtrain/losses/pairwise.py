"""Reward-model (Bradley-Terry) pairwise loss and its metrics, as pure tensor functions.

A reward model scores each sequence of a preference pair; the loss pushes the chosen score above the
rejected one. Like the LM loss, it is returned as a *sum* over pairs so the caller can normalise by
the number of pairs in the whole global batch (all micro-batches, all ranks). Metrics travel the
same way: per-micro-batch sums (`pairwise_stat_sums`), all-reduced by the caller, then turned into
means by `pairwise_metrics`.
"""

import math

import torch
import torch.nn.functional as F

# Order of the entries of `pairwise_stat_sums`.
PAIRWISE_STATS = ("correct", "margin", "reward_chosen", "reward_rejected", "reward_sq", "reward_sum")


def pairwise_loss_sum(
    r_chosen: torch.Tensor,
    r_rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """Σ over pairs of -logsigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)², a 0-d fp32 tensor.

    r_chosen, r_rejected: (P,) rewards; margin: (P,) or a scalar, the required gap per pair (None: 0).
    Divided by P this equals TRL's RewardTrainer loss (with `center_rewards_coefficient=center_coef`).
    The centring term keeps rewards near zero, which the pairwise term alone leaves unconstrained.
    """
    r_chosen, r_rejected = r_chosen.float(), r_rejected.float()  # (P,)
    gap = r_chosen - r_rejected  # (P,)
    if margin is not None:
        gap = gap - (margin.float() if torch.is_tensor(margin) else margin)
    losses = -F.logsigmoid(gap)  # (P,)
    if center_coef:
        losses = losses + center_coef * (r_chosen + r_rejected) ** 2
    return losses.sum()


@torch.no_grad()
def pairwise_stat_sums(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """(K,) float64 sums over pairs, named by PAIRWISE_STATS, for the caller to all-reduce.

    float64 because the reward std comes from Σr² and Σr: in fp32 that difference cancels badly
    when rewards drift far from zero.
    """
    chosen, rejected = r_chosen.detach().double(), r_rejected.detach().double()  # (P,)
    return torch.stack([
        (chosen > rejected).double().sum(),  # strict: a tie is not a correct ranking
        (chosen - rejected).sum(),
        chosen.sum(),
        rejected.sum(),
        (chosen.square() + rejected.square()).sum(),
        (chosen + rejected).sum(),
    ])


def pairwise_metrics(sums: dict[str, float], num_pairs: int) -> dict[str, float]:
    """All-reduced PAIRWISE_STATS sums over `num_pairs` pairs -> logged means and the reward std.

    reward_std is the population std over all 2P rewards (chosen and rejected together).
    """
    if num_pairs <= 0:
        raise ValueError(f"pairwise_metrics needs at least one pair, got num_pairs={num_pairs}")
    num_rewards = 2 * num_pairs
    mean_reward = sums["reward_sum"] / num_rewards
    variance = max(sums["reward_sq"] / num_rewards - mean_reward**2, 0.0)  # rounding can dip below 0
    return {
        "accuracy": sums["correct"] / num_pairs,
        "margin": sums["margin"] / num_pairs,
        "reward_chosen": sums["reward_chosen"] / num_pairs,
        "reward_rejected": sums["reward_rejected"] / num_pairs,
        "reward_std": math.sqrt(variance),
    }
