"""PPO losses as pure tensor functions: action log-probs, the clipped policy and value losses, metrics.

Shapes: B sequences, T tokens (prompt + generation), V vocabulary, A action (generated) positions,
the last A tokens of each row. `mask` (B, A) bool is True on every generated token up to and
including the first EOS. Everything is fp32 (inputs are cast).

Losses are per token, 0 outside the mask, and the caller *sums* them (`masked_sum`) and divides by
the action tokens of the whole global mini-batch (all micro-batches, all ranks), as the SFT loss is
normalised by its target tokens. That is TRL 1.16's GRPO default, loss_type="dapo"; its "grpo" loss
(mean over each sequence's tokens, then over sequences) weighs a short answer's tokens more. `aggregation_weights`
gives every ppo.loss_agg as per-token weights and a count.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

# masked_sum is also this module's: the stage sums the per-token losses below with it.
from llmtrain.losses.advantages import masked_mean, masked_sum  # noqa: F401


def action_logits(logits: torch.Tensor, num_actions: int) -> torch.Tensor:
    """(B, T, V) -> (B, A, V), a view: position t predicts token t + 1, so the last A tokens are
    predicted by positions T−A−1 … T−2. Slice once; feed the slice to `action_logps` and
    `entropy_from_logits` so no (B, T, V) fp32 copy is ever made.
    """
    if not 0 < num_actions < logits.size(1):
        raise ValueError(f"num_actions={num_actions} must be in [1, T) for T={logits.size(1)} positions")
    return logits[:, -num_actions - 1:-1]


def action_logps(logits: torch.Tensor, sequences: torch.Tensor, num_actions: int,
                 temperature: float = 1.0) -> torch.Tensor:
    """(B, A) fp32 log p(sequences[:, -A:]) under softmax(logits / temperature).

    logits: (B, T, V) the model's output for `sequences` (B, T). Sampling used the same temperature,
    so the log-probs here are those of the distribution the tokens were drawn from. Only the (B, A, V)
    slice is cast to fp32 (V can be 150k); cross-entropy gives the log-softmax-gather without
    materialising a log-softmax copy.
    """
    scaled = action_logits(logits, num_actions).float()  # (B, A, V)
    if temperature != 1.0:
        scaled = scaled / temperature
    targets = sequences[:, -num_actions:]  # (B, A)
    return -F.cross_entropy(scaled.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, A, V) action logits (`action_logits`) -> (B, A) fp32 entropy −Σ p log p of softmax(logits / T)."""
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logp = F.log_softmax(scaled, dim=-1)  # (B, A, V)
    return -(logp.exp() * logp).sum(dim=-1)


class PolicyTerms(NamedTuple):
    losses: torch.Tensor  # (B, A) fp32 clipped surrogate per token, 0 outside the mask; carries the gradient
    clipped: torch.Tensor  # (B, A) bool, the clipped branch was taken (strictly larger), inside the mask
    approx_kl: torch.Tensor  # (B, A) ½ (log π − log π_old)², k2 estimate of KL(π_old‖π), 0 outside; detached
    ratio: torch.Tensor  # (B, A) π / π_old (after the log-ratio clamp); detached


RATIO_LEVELS = ("token", "sequence")


def policy_loss_terms(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      clip_eps: float, log_ratio_clamp: float = 20.0, *, clip_eps_high: float | None = None,
                      clip_ratio_c: float | None = None, ratio_level: str = "token") -> PolicyTerms:
    """PPO's clipped surrogate (Schulman et al. 2017), per token: max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)).

    ρ = exp(clamp(log π − log π_old, ±log_ratio_clamp)): the clamp only matters for a diverged policy
    (e^20 ≈ 5e8), where it keeps the loss finite; a clamped ratio has no gradient, as a clipped one.
    On the first step on fresh samples log π == log π_old, so ρ is exactly 1 and the loss is −A.
    approx_kl is k2, the estimator TRL's PPOTrainer logged as `approxkl` (0.5 · mean(logprob_diff²));
    that trainer is gone from TRL 1.16.
    - clip_eps_high: DAPO's clip-higher (ε_high > ε_low = clip_eps lets unlikely tokens rise); None: clip_eps.
    - clip_ratio_c: dual-clip (Ye et al. 2020, verl): for A < 0 the loss is also capped at −A·c (c > 1), so a huge
      ratio on a bad token cannot blow the step up.
    - ratio_level="sequence": GSPO (Zheng et al. 2025, GSPO-token as verl): every token of a sequence takes the
      sequence's ratio exp(mean_t(log π − log π_old)) as its value, with log π_t's own gradient.
    """
    log_ratio = logp.float() - old_logp.float()  # (B, A)
    if ratio_level == "sequence":
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # (B, 1)
        mean_log_ratio = torch.where(mask, log_ratio, 0.0).sum(dim=-1, keepdim=True) / lengths  # (B, 1)
        log_ratio = logp.float() - logp.float().detach() + mean_log_ratio.detach()  # value: the sequence's
    ratio = torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))  # (B, A)
    adv = advantages.float()
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -adv * ratio  # (B, A)
    clipped_branch = -adv * ratio.clamp(1 - clip_eps, 1 + high)  # (B, A)
    pessimistic = torch.maximum(unclipped, clipped_branch)
    if clip_ratio_c is not None:
        pessimistic = torch.where(adv < 0, torch.minimum(pessimistic, -adv * clip_ratio_c), pessimistic)
    losses = torch.where(mask, pessimistic, 0.0)
    clipped = mask & (clipped_branch > unclipped)
    approx_kl = torch.where(mask, 0.5 * log_ratio.detach() ** 2, 0.0)
    return PolicyTerms(losses, clipped, approx_kl, ratio.detach())


def _clipped_values(values: torch.Tensor, old_values: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """V_old + clip(V − V_old, ±ε): the value may not move further than ε from the rollout's."""
    return old_values.float() + (values.float() - old_values.float()).clamp(-clip_eps, clip_eps)


def value_loss_terms(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                     clip_eps: float | None) -> torch.Tensor:
    """(B, A) ½·max((V − R)², (V_clipped − R)²), the pessimistic clipped value loss; ½ (V − R)² when
    clip_eps is None. 0 outside the mask. The ½ as in TRL's old PPOTrainer and OpenRLHF's ValueLoss.
    """
    returns = returns.float()
    losses = (values.float() - returns) ** 2  # (B, A)
    if clip_eps is not None:
        losses = torch.maximum(losses, (_clipped_values(values, old_values, clip_eps) - returns) ** 2)
    return torch.where(mask, 0.5 * losses, 0.0)


@torch.no_grad()
def value_clipped(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                  clip_eps: float | None) -> torch.Tensor:
    """(B, A) bool: the clipped branch of the value loss was taken (strictly larger), inside the mask.
    Sum it over the global batch and divide by the action tokens for the logged clip fraction."""
    if clip_eps is None:
        return torch.zeros_like(mask)
    returns = returns.float()
    return mask & ((_clipped_values(values, old_values, clip_eps) - returns) ** 2 > (values.float() - returns) ** 2)


@torch.no_grad()
def value_clip_frac(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                    clip_eps: float | None) -> torch.Tensor:
    """0-d fp32: the fraction of this rank's valid tokens where the value clip was taken (local)."""
    return masked_mean(value_clipped(values, old_values, returns, mask, clip_eps).float(), mask)


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-d fp32: 1 − Var(R − V) / Var(R) over this rank's valid tokens (local, no all-reduce: a metric).

    1: the critic predicts the returns; 0: no better than their mean; < 0: worse. NaN when the returns
    do not vary (undefined, as in Stable-Baselines3). Both variances are biased; the ratio is the same.
    """
    returns, values = returns.double(), values.double()

    def variance(x: torch.Tensor) -> torch.Tensor:
        mean = masked_mean(x, mask)
        return masked_mean((x - mean) ** 2, mask)

    var_returns = variance(returns)
    ratio = variance(returns - values) / var_returns
    return torch.where(var_returns > 0, 1 - ratio, float("nan")).float()


LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo", "seq_mean_token_sum_norm")


def resolve_loss_agg(loss_agg: str | None, ratio_level: str) -> str:
    """ppo.loss_agg as set, or (null) the ratio level's own: seq_mean_token_mean for GSPO (ratio_level="sequence":
    the paper's objective is a mean over sequences, and verl's GSPO recipe sets it), token_mean otherwise."""
    if loss_agg is not None:
        return loss_agg
    return "seq_mean_token_mean" if ratio_level == "sequence" else "token_mean"


def aggregation_weights(mask: torch.Tensor, loss_agg: str, max_new_tokens: int,
                        mini_batch_size: int | None = None) -> tuple[torch.Tensor, int]:
    """How the per-token losses ℓ_it of a micro-batch add up (verl's loss_agg_mode, TRL's loss_type): ((B, A) fp32
    weight per token, the count the step divides the weighted sum by, summed over micro-batches and ranks). Over the
    global mini-batch of N sequences (all its micro-batches), m_it the action mask, L = max_new_tokens:
    token_mean (TRL's "dapo", verl's token-mean):            Σ_it m·ℓ / Σ_it m             weight 1, count tokens
    seq_mean_token_mean (TRL's "grpo", verl's):               (1/N) Σ_i Σ_t m·ℓ / Σ_t m     weight 1/|y_i|, rows
    seq_mean_token_sum (TRL's "luspo", verl's):               (1/N) Σ_it m·ℓ                weight 1, rows
    dr_grpo (TRL's "dr_grpo", Dr. GRPO):                      Σ_it m·ℓ / (N·L)              weight 1/L, rows
    seq_mean_token_sum_norm (verl's agg_loss of that name):   Σ_it m·ℓ / L, not ÷ N         weight N/L, rows
    (verl's loss_scale_factor, default the response length; its trainer also scales each micro-batch's loss by
    micro/mini-batch size, a gradient-accumulation detail not copied: this is agg_loss over the whole mini-batch.)
    Every row counts in N, also one without action tokens (ppo.mask_truncated): TRL and verl divide by the batch.
    mini_batch_size: N, for seq_mean_token_sum_norm's weight (the step's sequences; None: this micro-batch's)."""
    lengths = mask.sum(dim=-1, keepdim=True)  # (B, 1)
    rows = mask.shape[0]
    if loss_agg == "token_mean":
        return mask.float(), int(mask.sum())
    if loss_agg == "seq_mean_token_mean":
        return mask.float() / lengths.clamp(min=1), rows
    if loss_agg == "seq_mean_token_sum":
        return mask.float(), rows
    if loss_agg == "dr_grpo":
        return mask.float() / max_new_tokens, rows
    if loss_agg == "seq_mean_token_sum_norm":  # Σ (N/L)·ℓ / N = Σ ℓ / L
        return mask.float() * (mini_batch_size or rows) / max_new_tokens, rows
    raise ValueError(f"loss_agg={loss_agg!r} is not one of {', '.join(LOSS_AGGREGATIONS)}")
