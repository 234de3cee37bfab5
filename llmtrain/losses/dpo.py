"""DPO losses as pure tensor functions, matched against TRL 1.16's DPOTrainer.

A preference pair is scored by the policy's and the frozen reference's log-probabilities of the
chosen and rejected completions (`sequence_logps`). The loss of a pair depends on
    logits = (π_c − π_r) − (ref_c − ref_r)
through a function picked from `DPO_LOSSES`. Losses are per pair; the caller sums them and divides
by the number of pairs in the global batch. Metrics travel as sums (`dpo_stat_sums`), all-reduced
by the caller, then turned into means by `dpo_metrics`.

Where this differs from TRL 1.16 (`trl/trainer/dpo_trainer.py`, `_compute_loss`):
- "sigmoid" with label_smoothing ε > 0 is the conservative DPO (cDPO) loss here. TRL 1.16's
  "sigmoid" ignores `label_smoothing`; the same formula is its "aot" loss without the sorting
  (identical for a single pair). Its "robust" loss is a different, debiased form.
- "ipo" uses length-averaged log-probs, as TRL does (it divides each summed log-ratio by the number
  of completion tokens). Pass `sequence_logps(..., average=True)` for the losses in
  AVERAGED_LOGPS. The rewards and log-prob metrics are then per-token too, whereas TRL logs them
  from summed log-probs even for IPO. (TRL counts completion tokens before the shift; the counts
  agree unless a completion starts at position 0, i.e. with an empty prompt.)
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmtrain.losses.lm import IGNORE_INDEX

# Order of the entries of `dpo_stat_sums`.
DPO_STATS = ("reward_correct", "reward_margin", "reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected")


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target) at each position, is-a-target mask), both (B, T), fp32; position t predicts label t+1.

    logits: (B, T, V); labels: (B, T), aligned with input_ids, IGNORE_INDEX where no log-prob counts.
    """
    # Pad the shifted labels back to T rather than slicing logits[:, :-1]: the slice would copy the
    # whole (B, T-1, V) tensor before the fp32 cast copies it again.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)
    logps = -F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(targets)  # (B, T), 0 where ignored
    return logps, targets != IGNORE_INDEX


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """(B,) fp32 sum (or per-token mean) of log p(target) over each row's target tokens.

    logits: (B, T, V); labels: (B, T), aligned with input_ids (position t predicts label t+1),
    IGNORE_INDEX where no log-prob counts (prompt, padding). A row without targets gives 0.
    """
    logps, is_target = token_logps(logits, labels)
    totals = logps.sum(dim=-1)  # (B,)
    if not average:
        return totals
    return totals / is_target.sum(dim=-1).clamp(min=1)


def packed_sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor,
                          num_sequences: int, average: bool = False) -> torch.Tensor:
    """(num_sequences,) like `sequence_logps`, for rows that hold several sequences back to back.

    sequence_ids: (B, T) long, the sequence each position belongs to (-1: padding). A log-prob counts for
    the sequence of the token it predicts; a sequence's first token is never a target (its label is masked
    when packed), so nothing is predicted across a boundary.
    """
    logps, _ = token_logps(logits, labels)  # (B, T)
    return sequence_sums(logps, labels, sequence_ids, num_sequences, average)


def sequence_sums(logps: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int,
                  average: bool = False) -> torch.Tensor:
    """(B, T) per-token log-probs (position t: label t + 1, 0 where ignored) -> (num_sequences,) summed (or averaged)
    over each sequence's target tokens, as `packed_sequence_logps`."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)
    owners = F.pad(sequence_ids[:, 1:], (0, 1), value=-1)  # (B, T) the predicted token's sequence
    totals, counts = owned_sums(logps, targets, owners, num_sequences)
    return totals / counts.clamp(min=1) if average else totals


def owned_sums(logps: torch.Tensor, targets: torch.Tensor, owners: torch.Tensor,
               num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) per-token log-probs, their targets and the sequence each target belongs to (-1: none), all aligned
    (position t predicts targets[t]) -> (num_sequences,) Σ log p and (num_sequences,) target count, fp32: each
    sequence's sums over the positions given (a sequence shard's part of them under sequence parallelism)."""
    kept = ((owners >= 0) & (targets != IGNORE_INDEX)).flatten()  # (B·T,)
    index = owners.flatten().clamp(min=0)[kept]
    totals = torch.zeros(num_sequences, device=logps.device).index_add_(0, index, logps.flatten()[kept])
    counts = torch.zeros(num_sequences, device=logps.device).index_add_(
        0, index, torch.ones_like(index, dtype=torch.float32))
    return totals, counts


# Each loss maps the (P,) log-ratios log π − log ref of the chosen (c) and rejected (r) responses, β and the label
# smoothing ε to (P,) losses, as TRL 1.16's DPOTrainer._compute_loss writes them (x = c − r).

def sigmoid_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """DPO: −logsigmoid(β·x); with ε = label_smoothing > 0, cDPO: the label is wrong with probability ε."""
    x = c - r
    return -(1 - eps) * F.logsigmoid(beta * x) - eps * F.logsigmoid(-beta * x)


def ipo_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """IPO: (x − 1/(2β))², β being the paper's τ; x from length-averaged log-probs (see AVERAGED_LOGPS)."""
    return (c - r - 1 / (2 * beta)) ** 2


def hinge_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """SLiC: relu(1 − β·x)."""
    return torch.relu(1 - beta * (c - r))


def robust_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024): the unbiased loss under labels flipped with probability ε < ½."""
    x = c - r
    return (-(1 - eps) * F.logsigmoid(beta * x) + eps * F.logsigmoid(-beta * x)) / (1 - 2 * eps)


def bco_pair_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """BCO on pairs: −logsigmoid(β·c) − logsigmoid(−β·r)."""
    return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)


def sppo_hard_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """SPPO with hard probabilities: (c − 1/(2β))² + (r + 1/(2β))²."""
    return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2


def nca_pair_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """NCA: −logsigmoid(β·c) − ½ logsigmoid(−β·c) − ½ logsigmoid(−β·r)."""
    return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)


def apo_zero_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, eq. 7): raise the chosen, lower the rejected likelihood."""
    return 1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)


def apo_down_loss(c: torch.Tensor, r: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """APO-down (eq. 8): lower both, the rejected more."""
    return torch.sigmoid(beta * c) + 1 - torch.sigmoid(beta * (c - r))


DPO_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": sigmoid_loss, "ipo": ipo_loss, "hinge": hinge_loss, "robust": robust_loss, "bco_pair": bco_pair_loss,
    "sppo_hard": sppo_hard_loss, "nca_pair": nca_pair_loss, "apo_zero": apo_zero_loss, "apo_down": apo_down_loss,
}
# Losses that take per-token mean log-probs (`sequence_logps(..., average=True)`), as TRL does.
AVERAGED_LOGPS = frozenset({"ipo"})
# Losses that read label_smoothing; any other loss refuses a non-zero value rather than ignore it.
SMOOTHED_LOSSES = frozenset({"sigmoid", "robust"})


class DPOTerms(NamedTuple):
    losses: torch.Tensor  # (P,) fp32, carries the gradient
    chosen_rewards: torch.Tensor  # (P,) β(π_c − ref_c), detached
    rejected_rewards: torch.Tensor  # (P,) β(π_r − ref_r), detached


def dpo_loss_terms(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
) -> DPOTerms:
    """Per-pair DPO losses and implicit rewards from (P,) sequence log-probs of policy and reference."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"dpo.loss={loss_type!r} is not a DPO loss; choose one of {sorted(DPO_LOSSES)}")
    if label_smoothing and loss_type not in SMOOTHED_LOSSES:
        raise ValueError(f"dpo.label_smoothing={label_smoothing} has no effect on dpo.loss={loss_type!r}; "
                         f"it applies to {sorted(SMOOTHED_LOSSES)} only, set it to 0")
    if loss_type == "robust" and not label_smoothing < 0.5:
        raise ValueError(f"dpo.loss=robust divides by 1 − 2·label_smoothing: dpo.label_smoothing={label_smoothing} "
                         "must be < 0.5")
    chosen_logratios = policy_chosen.float() - ref_chosen.float()  # (P,)
    rejected_logratios = policy_rejected.float() - ref_rejected.float()  # (P,)
    losses = DPO_LOSSES[loss_type](chosen_logratios, rejected_logratios, beta, label_smoothing)  # (P,)
    return DPOTerms(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


@torch.no_grad()
def dpo_stat_sums(terms: DPOTerms, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> torch.Tensor:
    """(K,) float64 sums over pairs, named by DPO_STATS, for the caller to all-reduce."""
    chosen, rejected = terms.chosen_rewards.double(), terms.rejected_rewards.double()  # (P,)
    return torch.stack([
        (chosen > rejected).double().sum(),  # strict: a tie is not a correct ranking
        (chosen - rejected).sum(),
        chosen.sum(),
        rejected.sum(),
        policy_chosen.detach().double().sum(),
        policy_rejected.detach().double().sum(),
    ])


def dpo_metrics(sums: dict[str, float], num_pairs: int) -> dict[str, float]:
    """All-reduced DPO_STATS sums over `num_pairs` pairs -> logged means over pairs."""
    if num_pairs <= 0:
        raise ValueError(f"dpo_metrics needs at least one pair, got num_pairs={num_pairs}")
    metric_names = {"reward_correct": "reward_accuracy"}
    return {metric_names.get(name, name): sums[name] / num_pairs for name in DPO_STATS}
