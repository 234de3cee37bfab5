"""The train–inference mismatch: importance weights for engine-sampled tokens, and how far apart the two are.

The rollout's tokens are sampled by an inference engine (vLLM, or our HF sampler) that returns the
log-prob of each sampled token, the *engine* (behaviour) log-probs. The trainer recomputes the old
log-probs with its own forward, the *trainer* log-probs. Kernels, dtypes and top-p truncation make
them differ, so the PPO ratio π_θ / π_old is not the ratio to the distribution that sampled.

TRL 1.16's GRPOTrainer corrects this with one more weight per token, ρ = π_old / π_engine
(`vllm_importance_sampling_correction`, grpo_trainer.py ~2660–2707, computed under no_grad), that
multiplies the per-token loss after clipping (~3146) — not the PPO ratio. Four modes (TRL's names):
    token_truncate     ρ_t = clamp(e^(old_t − eng_t), C_min, C_max)
    token_mask         ρ_t = e^(old_t − eng_t), set to 0 where outside [C_min, C_max]
    sequence_truncate  ρ = clamp(e^Σ_t(old_t − eng_t), C_min, C_max), one per sequence, on every token
    sequence_mask      ρ = e^Σ_t(old_t − eng_t), 0 for the whole sequence if outside (TRL's default)
The sequence ratio is the *product* of token ratios (a sum of log-ratios, not a mean). C_max defaults
to 3.0 and may be None (no upper bound), C_min to None (no lower bound); the bounds are inclusive.

Shapes: B sequences, A action positions; `mask` (B, A) bool is True on the action tokens. Everything
is fp32. Weights are (B, A) and, as TRL's, 1 off the mask in token modes (the sequence's weight in
sequence modes): the caller's loss is masked anyway.
"""

import math
from collections.abc import Callable

import torch

from llmtrain.losses.advantages import masked_mean
from llmtrain.losses.kl import k3


def _masked_log_ratio(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, A) old − engine, 0 off the mask and where the engine gave NaN (could not score a token: weight 1)."""
    diff = trainer_logps.detach().float() - engine_logps.detach().float()  # (B, A)
    # TRL: (old − sampling) * mask, then nan_to_num(nan=0); a where keeps a ±inf off the mask from becoming NaN.
    return torch.nan_to_num(torch.where(mask, diff, 0.0), nan=0.0)


def _truncate(ratio: torch.Tensor, clip_max: float | None, clip_min: float | None) -> torch.Tensor:
    if clip_max is None and clip_min is None:  # TRL reaches torch.clamp(min=None, max=None), which raises
        raise ValueError("a truncate mode needs clip_max or clip_min (both are None)")
    return ratio.clamp(min=clip_min, max=clip_max)


def _mask(ratio: torch.Tensor, clip_max: float | None, clip_min: float | None) -> torch.Tensor:
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _sequence_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.sum(dim=-1, keepdim=True))  # (B, 1): Π_t ρ_t over the action tokens


def token_truncate(log_ratio: torch.Tensor, clip_max: float | None, clip_min: float | None) -> torch.Tensor:
    """(B, A) masked old − engine log-ratio -> (B, A) clamp(e^x, C_min, C_max)."""
    return _truncate(torch.exp(log_ratio), clip_max, clip_min)


def token_mask(log_ratio: torch.Tensor, clip_max: float | None, clip_min: float | None) -> torch.Tensor:
    """(B, A) -> (B, A) e^x, 0 on each token whose ratio is outside [C_min, C_max]."""
    return _mask(torch.exp(log_ratio), clip_max, clip_min)


def sequence_truncate(log_ratio: torch.Tensor, clip_max: float | None, clip_min: float | None) -> torch.Tensor:
    """(B, A) -> (B, A): every token of a sequence gets clamp(e^Σx, C_min, C_max)."""
    return _truncate(_sequence_ratio(log_ratio), clip_max, clip_min).expand_as(log_ratio)


def sequence_mask(log_ratio: torch.Tensor, clip_max: float | None, clip_min: float | None) -> torch.Tensor:
    """(B, A) -> (B, A): every token of a sequence gets e^Σx, or 0 if that is outside [C_min, C_max]."""
    return _mask(_sequence_ratio(log_ratio), clip_max, clip_min).expand_as(log_ratio)


ImportanceMode = Callable[[torch.Tensor, float | None, float | None], torch.Tensor]
IMPORTANCE_SAMPLING_MODES: dict[str, ImportanceMode] = {
    "token_truncate": token_truncate, "token_mask": token_mask,
    "sequence_truncate": sequence_truncate, "sequence_mask": sequence_mask,
}
SEQUENCE_LEVEL_MODES = frozenset({"sequence_truncate", "sequence_mask"})


@torch.no_grad()
def importance_weights(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor,
                       mode: str = "sequence_mask", clip_max: float | None = 3.0,
                       clip_min: float | None = None) -> torch.Tensor:
    """(B, A) fp32 weights ρ that multiply the per-token policy loss, detached (TRL computes them under no_grad).

    trainer_logps: (B, A) the trainer's old log-probs (π_old, recomputed before the update);
    engine_logps: (B, A) the sampler's log-probs of the same tokens (NaN: unscored, weight 1).
    Defaults are TRL 1.16's: vllm_importance_sampling_mode="sequence_mask", clip_max=3.0, clip_min=None.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; one of {sorted(IMPORTANCE_SAMPLING_MODES)}")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:  # GRPOConfig.__post_init__'s check
        raise ValueError(f"clip_min={clip_min} must be less than clip_max={clip_max}")
    return IMPORTANCE_SAMPLING_MODES[mode](_masked_log_ratio(trainer_logps, engine_logps, mask), clip_max, clip_min)


@torch.no_grad()
def off_policy_mask(advantages: torch.Tensor, policy_logps: torch.Tensor, behaviour_logps: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, 1) fp32, 1 keep / 0 drop: DeepSeek-V3.2's off-policy sequence mask (eq. 9), TRL's off_policy_mask_threshold.

    TRL's GRPOTrainer.get_off_policy_mask (grpo_trainer.py ~2945–2969), applied in _compute_loss as
    `per_token_loss * mask` before the importance weight. A sequence is dropped when its advantage is
    negative *and* its mean over action tokens of (behaviour − policy) log-probs — a k1 estimate of
    KL(behaviour ‖ π_θ) — exceeds `threshold` (δ, e.g. 0.5). policy_logps: (B, A) the *current* π_θ
    (being trained; detached here); behaviour_logps: (B, A) the engine's log-probs when an engine
    sampled (TRL: vLLM's), else the old trainer log-probs. NaN behaviour log-probs count as 0.
    advantages: (B,) or (B, A) (then the mask is (B, A), as TRL's).
    """
    kl = torch.nan_to_num(behaviour_logps.float() - policy_logps.detach().float(), nan=0.0)  # (B, A)
    seq_kl = masked_mean(kl, mask, dim=1).unsqueeze(1)  # (B, 1), 0 for an empty row (TRL: clamp(min=1))
    advantages = advantages.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1)
    return ((advantages >= 0) | (seq_kl <= threshold)).float()


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    return x[mask].max().item() if mask.any() else 0.0


@torch.no_grad()
def mismatch_metrics(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor,
                     clip_eps_low: float, clip_eps_high: float) -> dict[str, float]:
    """How far the trainer's log-probs are from the engine's, over the action tokens (local, no all-reduce).

    With x = trainer − engine per token (tokens the engine left NaN are excluded, as TRL does):
      mismatch_logp_abs_mean / _max   mean / max |x|: TRL's sampling/sampling_logp_difference/{mean,max}
      mismatch_kl                     mean of k3 = e^x − x − 1, an unbiased estimate of KL(engine ‖ trainer)
                                      per token since the engine sampled the tokens (TRL logs no such KL)
      mismatch_frac_outside_clip      fraction with e^x outside [1 − clip_eps_low, 1 + clip_eps_high]
    An empty mask gives 0 for each.
    """
    log_ratio = trainer_logps.float() - engine_logps.float()  # (B, A)
    valid = mask & ~torch.isnan(log_ratio)  # (B, A)
    ratio = torch.exp(log_ratio)  # (B, A)
    outside = (ratio < 1 - clip_eps_low) | (ratio > 1 + clip_eps_high)  # (B, A)
    return {
        "mismatch_logp_abs_max": _masked_max(log_ratio.abs(), valid),
        "mismatch_logp_abs_mean": masked_mean(log_ratio.abs(), valid).item(),
        "mismatch_kl": masked_mean(k3(engine_logps, trainer_logps), valid).item(),
        "mismatch_frac_outside_clip": masked_mean(outside.float(), valid).item(),
    }


@torch.no_grad()
def importance_weight_metrics(weights: torch.Tensor, mask: torch.Tensor, mode: str) -> dict[str, float]:
    """Min / mean / max of `importance_weights`: TRL's sampling/importance_sampling_ratio/{min,mean,max}.

    As TRL, over the action tokens in token modes and over the sequences (one weight each, empty ones
    too) in sequence modes. Nothing to count gives 0.
    """
    kept = weights[:, :1].flatten() if mode in SEQUENCE_LEVEL_MODES else weights[mask]
    if kept.numel() == 0:
        return {"mismatch_is_ratio_min": 0.0, "mismatch_is_ratio_mean": 0.0, "mismatch_is_ratio_max": 0.0}
    return {"mismatch_is_ratio_min": kept.min().item(), "mismatch_is_ratio_mean": kept.float().mean().item(),
            "mismatch_is_ratio_max": kept.max().item()}
