"""KTO losses as pure tensor functions, matched against TRL 1.16's KTOTrainer (`trl/trainer/kto_trainer.py`).

A completion y of a prompt x is marked desirable or undesirable (unpaired). Its log-ratio is
    r = log π(y|x) − log π_ref(y|x)   (summed over the completion's tokens)
and its loss, from `KTO_LOSSES`, compares β·r with a reference point z0:
- kto (Ethayarajh et al. 2024, eq. 7): desirable 1 − σ(β(r − z0)), undesirable 1 − σ(β(z0 − r));
- apo_zero_unpaired (D'Oosterlinck et al. 2024, unpaired): desirable 1 − σ(βr), undesirable σ(βr) (no z0).
Each is weighted by kto.desirable_weight or kto.undesirable_weight. The loss of a step is Σ weighted losses over the
global batch's completions / its completions (TRL: the mean over its batch).

z0 (`kl_reference_point`) is the policy-vs-reference KL estimated on mismatched prompt-completion pairs (x_i with
y_{i−1}): clamp(mean(log π(y'|x) − log π_ref(y'|x)), min=0), detached. TRL takes the mean over a rank's micro-batch
and then over ranks, which depends on the layout; here it is the mean over the GLOBAL batch (every micro-batch of every
rank), so backends and layouts agree; on one batch and one rank the two are the same number.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

# Sums of a step (`kto_stat_sums`), in this order; `kto_metrics` turns them into TRL's logged means.
KTO_STATS = ("desirable", "undesirable", "reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected")


def _kto(logratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.where(desirable, 1 - torch.sigmoid(beta * (logratios - kl)),
                       1 - torch.sigmoid(beta * (kl - logratios)))


def _apo_zero_unpaired(logratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
                       beta: float) -> torch.Tensor:
    return torch.where(desirable, 1 - torch.sigmoid(beta * logratios), torch.sigmoid(beta * logratios))


# kto.loss_type -> (log-ratios (N,), desirable (N,) bool, z0 (0-d), β) -> per-completion loss (N,)
KTO_LOSSES: dict[str, Callable] = {"kto": _kto, "apo_zero_unpaired": _apo_zero_unpaired}
USES_KL = frozenset({"kto"})  # the loss types whose reference point is the KL estimate (TRL's calculate_KL)


class KTOTerms(NamedTuple):
    losses: torch.Tensor  # (N,) fp32 weighted per-completion loss, differentiable through the policy's log-probs
    rewards: torch.Tensor  # (N,) fp32 β · r, detached


def kl_reference_point(kl_sum: float | torch.Tensor, count: float | torch.Tensor) -> torch.Tensor:
    """z0: Σ over the global batch of (log π − log π_ref) of the mismatched completions / their number, at least 0,
    as a detached fp32 0-d tensor (0 when the batch is empty)."""
    kl_sum = torch.as_tensor(kl_sum, dtype=torch.float64)
    return (kl_sum / max(float(count), 1.0)).clamp(min=0).float().detach()


def kto_loss_terms(policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor,
                   kl: torch.Tensor, *, beta: float, loss_type: str, desirable_weight: float = 1.0,
                   undesirable_weight: float = 1.0) -> KTOTerms:
    """policy_logps, reference_logps (N,) summed completion log-probs; desirable (N,) bool; kl: z0 (0-d, detached)."""
    if loss_type not in KTO_LOSSES:
        raise ValueError(f"kto.loss_type={loss_type!r} is not one of {', '.join(KTO_LOSSES)}")
    logratios = policy_logps.float() - reference_logps.float()  # (N,)
    desirable = desirable.bool()
    kl = torch.as_tensor(kl, dtype=torch.float32, device=logratios.device).detach()
    weights = torch.where(desirable, desirable_weight, undesirable_weight).to(logratios.dtype)  # (N,)
    losses = weights * KTO_LOSSES[loss_type](logratios, desirable, kl, beta)
    return KTOTerms(losses, beta * logratios.detach())


def kto_stat_sums(terms: KTOTerms, policy_logps: torch.Tensor, desirable: torch.Tensor,
                  counted: torch.Tensor) -> torch.Tensor:
    """(len(KTO_STATS),) fp64 sums over the completions that count (`counted` (N,) 1 or 0)."""
    good = desirable.double() * counted.double()  # (N,)
    bad = (1 - desirable.double()) * counted.double()  # (N,)
    rewards, logps = terms.rewards.double(), policy_logps.detach().double()
    return torch.stack([good.sum(), bad.sum(), (rewards * good).sum(), (rewards * bad).sum(), (logps * good).sum(),
                        (logps * bad).sum()])


def kto_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Means of `kto_stat_sums` summed over the global batch, named as DPO's (TRL's rewards/chosen ...)."""
    chosen, rejected = max(sums["desirable"], 1.0), max(sums["undesirable"], 1.0)
    metrics = {"reward_chosen": sums["reward_chosen"] / chosen, "reward_rejected": sums["reward_rejected"] / rejected,
               "logp_chosen": sums["logp_chosen"] / chosen, "logp_rejected": sums["logp_rejected"] / rejected,
               "desirable": int(sums["desirable"]), "undesirable": int(sums["undesirable"])}
    metrics["reward_margin"] = metrics["reward_chosen"] - metrics["reward_rejected"]
    return metrics


def mismatched_kl_sum(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor,
                      counted: torch.Tensor) -> torch.Tensor:
    """0-d fp64: Σ (log π − log π_ref) of the mismatched completions that count (to be summed over the global batch)."""
    return ((policy_kl_logps.double() - reference_kl_logps.double()) * counted.double()).sum().detach()
