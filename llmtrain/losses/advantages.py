"""Advantage estimation for PPO (GAE with a critic) and GRPO (group-normalised scores), as pure functions.

Shapes: B sequences, A action (generated) positions. `mask` (B, A) bool is True on every generated
token up to and including the first EOS. Everything is fp32 (inputs are cast) and detached:
advantages and returns are regression targets, never differentiated through.

The stage picks an estimator by name from `ADVANTAGE_ESTIMATORS`; `needs_critic[name]` tells it
whether to build a critic. Every estimator takes one `AdvantageInputs` and returns
(advantages (B, A), returns (B, A) or None), both 0 outside the mask.

Unscored rows (`AdvantageInputs.scored` False: every reward function returned None, TRL's "unscorable"
completions) are left out of every group statistic (mean, std, leave-one-out baseline) and get advantage 0,
as TRL 1.16's GRPOTrainer and RLOOTrainer do with NaN rewards (nanmean, nanstd, nan_to_num).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmtrain.distributed import all_reduce_sum


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x where mask is True (a where, not a product: a NaN or inf under the mask cannot leak)."""
    kept = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x where mask is True; 0 where nothing is kept (not NaN). Local: no all-reduce."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


@torch.no_grad()
def whiten(values: torch.Tensor, mask: torch.Tensor, group=None, shift_mean: bool = True,
           eps: float = 1e-8, reduce: bool = True) -> torch.Tensor:
    """(B, A) -> (B, A): (x − mean) / sqrt(var + eps) over the valid tokens of the whole global batch.

    One all-reduce (over `group`, default every rank) of [Σx, Σx², count] in float64, so every rank
    whitens with the same statistics whatever its share of tokens; a rank with no valid token still
    joins the reduce (it adds zeros), or the others would wait for it forever. Ranks that hold the
    same examples (tensor-parallel peers) scale all three sums alike, which leaves mean and variance
    unchanged. The variance is the biased one (÷ count): with thousands of tokens the choice does not
    matter, and it gives the whitened tokens exactly unit variance. TRL's old `masked_whiten` (gone
    from 1.16 with its PPOTrainer) used the unbiased one, over the local batch. float64 keeps
    E[x²] − E[x]² clear of cancellation. shift_mean=False adds the mean back (TRL's option): only
    the scale is normalised, as for rewards, whose level carries meaning.
    Masked-out positions come back as 0. reduce=False: every rank holds the whole global batch already.
    """
    x = values.double()
    stats = torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum().double()])  # (3,)
    total, total_sq, count = (all_reduce_sum(stats, group) if reduce else stats).unbind()
    count = count.clamp(min=1)
    mean = total / count
    var = (total_sq / count - mean * mean).clamp(min=0)
    whitened = (x - mean) * torch.rsqrt(var + eps)  # (B, A)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0).float()


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016): (advantages, returns), both (B, A).

    δ_t = r_t + γ·V_{t+1} − V_t,   A_t = δ_t + γλ·A_{t+1},   returns_t = A_t + V_t (before any whitening).
    Rewards and values outside the mask count as 0, so past the last action nothing is bootstrapped:
    the last action's δ is r_T − V_T. Outputs are 0 outside the mask. A is small, hence the loop over
    positions, vectorised over B.
    """
    r = torch.where(mask, rewards.float(), 0.0)  # (B, A)
    v = torch.where(mask, values.float(), 0.0)  # (B, A)
    next_values = F.pad(v[:, 1:], (0, 1))  # (B, A): V_{t+1}, 0 past the end
    deltas = r + gamma * next_values - v  # (B, A)
    running = torch.zeros_like(deltas[:, 0])  # (B,)
    columns = []
    for t in reversed(range(deltas.size(1))):
        running = deltas[:, t] + gamma * lam * running
        columns.append(running)
    advantages = torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(deltas)  # (B, A)
    advantages = torch.where(mask, advantages, 0.0)
    return advantages, torch.where(mask, advantages + v, 0.0)


SCALE_REWARDS = ("group", "batch", "none")


def kept_mean(x: torch.Tensor, kept: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x where `kept` over `dim` (None: every element), the reduced dims kept as size 1; 0 where none is
    kept (TRL's nanmean, whose NaN there ends as advantage 0 too)."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    return torch.where(kept, x, 0.0).sum(dims, keepdim=True) / kept.sum(dims, keepdim=True).clamp(min=1)


def kept_std(x: torch.Tensor, kept: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased (÷ (n − 1)) std of x where `kept`, as kept_mean; 0 where fewer than 2 are kept (TRL's nanstd is NaN
    there; the advantage (x − mean) / (std + eps) of a lone kept row is 0 either way)."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    count = kept.sum(dims, keepdim=True)
    deviations = torch.where(kept, (x - kept_mean(x, kept, dim)) ** 2, 0.0)
    variance = deviations.sum(dims, keepdim=True) / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), 0.0)


@torch.no_grad()
def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-4, scale: str = "group",
                     scored: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO (Shao et al. 2024): (N,) scores -> (N,) (score − group mean) / (group std + eps).

    Sample i answers prompt i // group_size, so a group is a consecutive run of `group_size`
    samples; the caller must hold whole groups (TRL gathers the scores of all ranks first).
    As TRL 1.16's GRPOTrainer with its default scale_rewards="group": the std is the unbiased one
    (Bessel, ÷ (n − 1), its `nanstd`), eps = 1e-4 is added to the std (not the variance), in fp32.
    A group of one sample has std 0 by convention (TRL does the same), so its advantage is 0, not NaN.
    scale="batch": the std of the whole batch instead (TRL's scale_rewards="batch"); "none": only the group mean is
    subtracted (Dr. GRPO: dividing by a group's std weighs nearly-solved prompts up).
    scored (N,) bool: False rows (no reward function scored them) are out of the mean and std and get 0, as TRL's
    NaN rewards; None: every row is scored.
    """
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of group_size={group_size}")
    kept = torch.ones(scores.shape, dtype=torch.bool, device=scores.device) if scored is None else scored.bool()
    grouped, kept = scores.float().view(-1, group_size), kept.view(-1, group_size)  # (N / K, K)
    centred = grouped - kept_mean(grouped, kept, dim=1)  # (N / K, K)
    if scale != "none":
        std = kept_std(grouped, kept, dim=None if scale == "batch" else 1)  # (1, 1) or (N / K, 1), unbiased
        centred = centred / (std + eps)
    return torch.where(kept, centred, 0.0).view(-1)  # (N,)


def last_action(mask: torch.Tensor) -> torch.Tensor:
    """(B, A) bool action mask -> (B, A) bool: its last True per row (none for a row without actions)."""
    num_actions = mask.size(1)
    last = num_actions - 1 - mask.flip(1).long().argmax(dim=1)  # (B,) index of the last True
    return F.one_hot(last, num_actions).bool() & mask.any(dim=1, keepdim=True)


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, A) token rewards -> (B, A) G_t = Σ_{k ≥ t} γ^(k−t)·r_k over the action tokens, 0 outside the mask
    (OpenRLHF's get_cumulative_returns)."""
    r = torch.where(mask, rewards.float(), 0.0)
    running = torch.zeros_like(r[:, 0])
    columns = []
    for t in reversed(range(r.size(1))):
        running = r[:, t] + gamma * running
        columns.append(running)
    returns = torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(r)
    return torch.where(mask, returns, 0.0)


@torch.no_grad()
def token_rewards(kl: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """(B, A) per-token rewards: −kl_coef·kl_t on every action token, plus the sequence's score on its last.

    kl: (B, A) a per-token KL estimate; scores: (B,) the reward model's (or function's) score.
    The last action token is the last True of the row's mask (the EOS, or the last token when the
    generation was cut off); a row without action tokens gets nothing.
    """
    rewards = torch.where(mask, -kl_coef * kl.float(), 0.0)  # (B, A)
    return rewards + torch.where(last_action(mask), scores.float().unsqueeze(1), 0.0)


@dataclass(frozen=True)
class AdvantageInputs:
    token_rewards: torch.Tensor  # (B, A) fp32, `token_rewards(...)`: −β·KL per token + score at the last
    values: torch.Tensor | None  # (B, A) the critic's values at action tokens; None without a critic
    mask: torch.Tensor  # (B, A) bool action mask
    scores: torch.Tensor  # (B,) sequence scores (no KL); B = prompts × group_size, groups consecutive
    group_size: int  # samples per prompt
    gamma: float  # discount (GAE, REINFORCE++)
    lam: float  # GAE λ
    scale_rewards: str = "group"  # grpo: group | batch | none (SCALE_REWARDS)
    scored: torch.Tensor | None = None  # (B,) bool: False where no reward function scored the row; None: all scored

    def scored_rows(self) -> torch.Tensor:
        """(B,) bool: the rows a reward function scored (out of group statistics otherwise, advantage 0)."""
        if self.scored is None:
            return torch.ones(self.scores.shape, dtype=torch.bool, device=self.scores.device)
        return self.scored.bool()


def gae_estimator(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: GAE on the per-token rewards against the critic's values."""
    if inputs.values is None:
        raise ValueError("the gae advantage estimator needs the critic's values, got values=None")
    return gae(inputs.token_rewards, inputs.values, inputs.mask, inputs.gamma, inputs.lam)


def grpo_estimator(inputs: AdvantageInputs) -> tuple[torch.Tensor, None]:
    """GRPO: every action token of a sample gets its group-normalised return; no critic, no returns kept. The return
    is the sum of the token rewards: the score, minus β·ΣKL when the KL is in the reward (as verl), exactly the score
    otherwise (the other tokens' rewards are 0)."""
    advantages = group_advantages(inputs.token_rewards.sum(dim=1), inputs.group_size,
                                  scale=inputs.scale_rewards, scored=inputs.scored)  # (B,)
    return torch.where(inputs.mask, advantages.unsqueeze(1), 0.0), None


def rloo_estimator(inputs: AdvantageInputs) -> tuple[torch.Tensor, None]:
    """RLOO (Ahmadian et al. 2024, TRL's RLOOTrainer): each sample's return minus the mean return of the other K − 1
    samples of its group, on every action token. Returns as grpo's (score − β·ΣKL in the reward). As TRL: the mean
    is over the scored siblings only; a row without any (or unscored itself) gets 0."""
    k = inputs.group_size
    if k < 2 or inputs.scores.numel() % k:
        raise ValueError(f"rloo needs groups of at least 2 samples, got group_size={k} for {inputs.scores.numel()}")
    kept = inputs.scored_rows().view(-1, k)  # (N / K, K)
    returns = torch.where(kept, inputs.token_rewards.sum(dim=1).view(-1, k), 0.0)  # (N / K, K)
    others = kept.sum(dim=1, keepdim=True) - kept.long()  # (N / K, K) scored siblings
    baseline = (returns.sum(dim=1, keepdim=True) - returns) / others.clamp(min=1)  # leave-one-out mean
    advantages = torch.where(kept & (others > 0), returns - baseline, 0.0).view(-1)  # (N,)
    return torch.where(inputs.mask, advantages.unsqueeze(1), 0.0), None


def reinforce_pp_estimator(inputs: AdvantageInputs) -> tuple[torch.Tensor, None]:
    """REINFORCE++ (Hu 2025, OpenRLHF's "reinforce"): the discounted return-to-go of the token rewards (−β·KL per
    token, the score at the last), no critic and no group baseline; ppo.whiten_advantages normalises it over the
    global batch, as the method does (required: checks.py refuses whiten_advantages=false, stage=grpo's preset)."""
    return discounted_returns(inputs.token_rewards, inputs.mask, inputs.gamma), None


def reinforce_pp_baseline_estimator(inputs: AdvantageInputs) -> tuple[torch.Tensor, None]:
    """REINFORCE++ with a baseline as OpenRLHF's "reinforce_baseline": the score minus its group's mean score at the
    last action token (the −β·KL tokens untouched), then the discounted return-to-go
        A_t = Σ_{k ≥ t} γ^(k−t)·r'_k,   r'_k = −β·KL_k (+ score − mean_group(score) at the last token),
    normalised over the global batch by ppo.whiten_advantages (required: checks.py). The group mean is over the
    scored rows; an unscored row gets 0."""
    k = inputs.group_size
    if inputs.scores.numel() % k:
        raise ValueError(f"{inputs.scores.numel()} scores do not split into groups of group_size={k}")
    kept = inputs.scored_rows()  # (N,)
    group_mean = kept_mean(inputs.scores.float().view(-1, k), kept.view(-1, k), dim=1).expand(-1, k).reshape(-1)
    shifted = inputs.token_rewards - torch.where(last_action(inputs.mask), group_mean.unsqueeze(1), 0.0)
    return torch.where(kept.unsqueeze(1), discounted_returns(shifted, inputs.mask, inputs.gamma), 0.0), None


def reinforce_pp_baseline_verl_estimator(inputs: AdvantageInputs) -> tuple[torch.Tensor, None]:
    """REINFORCE++ with a baseline as verl's "reinforce_plus_plus_baseline": each sample's return, the sum of its
    token rewards (score − β·ΣKL with the KL in the reward), minus its group's mean return, the same on every action
        A_t = Σ_k r_k − mean_group(Σ_k r_k)   (no return-to-go: γ plays no part),
    normalised over the global batch by ppo.whiten_advantages (required: checks.py; verl whitens inside). Equal to
    reinforce_pp_baseline when the KL is not in the reward and γ = 1; with −β·KL per token in the reward the two
    differ (here the KL enters the baseline and every token carries the sequence's total). Group mean over the
    scored rows; an unscored row gets 0."""
    k = inputs.group_size
    if inputs.scores.numel() % k:
        raise ValueError(f"{inputs.scores.numel()} scores do not split into groups of group_size={k}")
    kept = inputs.scored_rows().view(-1, k)  # (N / K, K)
    returns = inputs.token_rewards.sum(dim=1).view(-1, k)  # (N / K, K)
    advantages = torch.where(kept, returns - kept_mean(returns, kept, dim=1), 0.0).view(-1)  # (N,)
    return torch.where(inputs.mask, advantages.unsqueeze(1), 0.0), None


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor | None]]] = {
    "gae": gae_estimator,
    "grpo": grpo_estimator,
    "rloo": rloo_estimator,
    "reinforce_pp": reinforce_pp_estimator,
    "reinforce_pp_baseline": reinforce_pp_baseline_estimator,  # OpenRLHF's
    "reinforce_pp_baseline_verl": reinforce_pp_baseline_verl_estimator,  # verl's
}
# Whether an estimator reads `values`, i.e. whether the stage must build and train a critic.
needs_critic: dict[str, bool] = {"gae": True, "grpo": False, "rloo": False, "reinforce_pp": False,
                                 "reinforce_pp_baseline": False, "reinforce_pp_baseline_verl": False}
# Whether it compares the samples of a prompt (ppo.rollout.n_samples_per_prompt >= 2).
needs_groups: dict[str, bool] = {"gae": False, "grpo": True, "rloo": True, "reinforce_pp": False,
                                 "reinforce_pp_baseline": True, "reinforce_pp_baseline_verl": True}
# Whether only ppo.whiten_advantages normalises its advantages (REINFORCE++: OpenRLHF and verl whiten them over the
# batch; unwhitened, their scale is the raw returns'). checks.py refuses these with whiten_advantages=false.
needs_whitening: dict[str, bool] = {"gae": False, "grpo": False, "rloo": False, "reinforce_pp": True,
                                    "reinforce_pp_baseline": True, "reinforce_pp_baseline_verl": True}
