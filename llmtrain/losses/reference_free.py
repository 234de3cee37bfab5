"""Reference-free preference losses (SimPO, ORPO) as pure tensor functions, matched against TRL 1.16.

Neither needs a frozen reference model: a pair is scored by the policy's own length-averaged log-probs of
its chosen and rejected responses, a = log π(y|x) / |y| with |y| the number of target tokens
(`sequence_logps(..., average=True)`, or `packed_sequence_logps(..., average=True)`); these are the inputs
TRL's `CPOTrainer.cpo_loss` (loss_type="simpo") and `ORPOTrainer.odds_ratio_loss` take too. Losses are
per pair; the caller sums them and divides by the pairs of the global batch.

SimPO (Meng et al. 2024, arXiv:2405.14734): reward r = β·a, loss −logsigmoid(r_c − r_r − γ).
  γ (`simpo.gamma`) is the target margin on the reward scale. TRL 1.16 uses the same convention: its
  `CPOConfig.simpo_gamma` is γ (`cpo_loss` subtracts simpo_gamma/β from the log-prob gap and multiplies
  by β again), so TRL's simpo_gamma = our gamma. Others take the ratio γ/β (the SimPO authors' later
  trainer and oat: `gamma_beta_ratio`): their gamma_beta_ratio = our gamma / beta.
  SimPO is TRL's CPO with loss_type="simpo" and cpo_alpha=0 (no NLL term); label smoothing is not offered.

ORPO (Hong et al. 2024, arXiv:2403.07691): NLL of the chosen response + β·(−logsigmoid(log_odds)), with
  log_odds = log[odds(a_c) / odds(a_r)], odds(a) = e^a / (1 − e^a):
  log_odds = (a_c − a_r) − (log(1 − e^{a_c}) − log(1 − e^{a_r})).
  This file gives the odds-ratio part per pair; the NLL part is the stage's (the chosen responses' summed
  token NLL over the chosen target tokens of the global batch). Sign: TRL's `odds_ratio_loss` returns
  β·logsigmoid(log_odds) (a log-likelihood, ≤ 0) and subtracts its mean; `ORPOTerms.losses` is its negative,
  a loss ≥ 0 to add. Where TRL differs: its NLL covers the prompt tokens as well as the response, and is a
  mean over the local micro-batch's tokens.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

# Mean log-probs are clamped to ≤ −LOGP_CLAMP before log(1 − e^a): at a = 0 (every token certain) the
# odds are infinite and the gradient NaN. fp32 log-softmax cannot resolve a log-prob this close to 0 anyway
# (its ulp at a logit of ~10 is ~1e-6), so only saturated responses are affected; their gradient through
# the odds term is 0 (clamped), and bounded by β/LOGP_CLAMP just below the clamp.
LOGP_CLAMP = 1e-6
LN_HALF = -0.6931471805599453  # where log1mexp switches forms (Mächler 2012), as TRL's `log1mexp`


class SimPOTerms(NamedTuple):
    losses: torch.Tensor  # (P,) fp32, carries the gradient
    chosen_rewards: torch.Tensor  # (P,) β·a_c, detached
    rejected_rewards: torch.Tensor  # (P,) β·a_r, detached


class ORPOTerms(NamedTuple):
    losses: torch.Tensor  # (P,) fp32 β·(−logsigmoid(log_odds)) ≥ 0, carries the gradient
    log_odds: torch.Tensor  # (P,) log odds(chosen) − log odds(rejected), detached (TRL logs its mean)
    chosen_rewards: torch.Tensor  # (P,) β·a_c, detached (as TRL logs them)
    rejected_rewards: torch.Tensor  # (P,) β·a_r, detached


def simpo_terms(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float,
                gamma: float) -> SimPOTerms:
    """Per-pair SimPO losses and rewards from (P,) length-averaged log-probs a = log π(y|x) / |y|."""
    chosen_rewards = beta * chosen_logps.float()  # (P,)
    rejected_rewards = beta * rejected_logps.float()  # (P,)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)  # (P,)
    return SimPOTerms(losses, chosen_rewards.detach(), rejected_rewards.detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − e^x) for x < 0, accurate near 0 (log(−expm1 x)) and far below it (log1p(−e^x)).

    Both branches are finite with finite gradients on x ≤ −LOGP_CLAMP, so torch.where's unselected
    branch cannot turn a gradient into NaN (0·inf) for the callers here, which clamp first.
    """
    return torch.where(x < LN_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_terms(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float) -> ORPOTerms:
    """Per-pair ORPO odds-ratio losses from (P,) length-averaged log-probs a = log π(y|x) / |y| (< 0)."""
    a_c = chosen_logps.float().clamp(max=-LOGP_CLAMP)  # (P,)
    a_r = rejected_logps.float().clamp(max=-LOGP_CLAMP)  # (P,)
    log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))  # (P,)
    losses = -beta * F.logsigmoid(log_odds)  # (P,)
    return ORPOTerms(losses, log_odds.detach(), beta * chosen_logps.detach().float(),
                     beta * rejected_logps.detach().float())
