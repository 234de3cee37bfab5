"""KL between the policy and the frozen reference: per-token estimators and the coefficient's controllers.

The policy samples the tokens, so the KL(π‖ref) = E_π[log π − log ref] is estimated per sampled
token from the two log-probabilities (Schulman, "Approximating KL divergence", 2020):
    k1 = log π − log ref                 unbiased, high variance, can be negative
    k2 = ½ (log π − log ref)²            biased, low variance, ≥ 0
    k3 = e^(ref − π) − (ref − π) − 1     unbiased, low variance, ≥ 0 (GRPO's per-token KL), capped at 10
Each maps (B, A) log-probs to a (B, A) estimate, elementwise; the caller applies the action mask.

The coefficient that weighs the KL is either fixed or adapted towards a target KL (Ziegler et al.
2019, as TRL's old PPOTrainer). A controller is stage state: `state_dict()` holds plain floats so
that a resumed run continues with the bit-identical coefficient.
"""

import math
from collections.abc import Callable

import torch

# exp() of a log-ratio above ~88 overflows fp32. A policy that has just left the reference cannot get
# there, but one that has diverged can; ±20 keeps k3 finite (e^20 ≈ 5e8). Then the estimate itself is
# clamped to [−10, 10] (it is ≥ 0: at most 10), exactly as verl's kl_penalty "low_var_kl": one diverged
# token weighs at most 10 in the KL (not 5e8) and, clamped, sends it no gradient, so it cannot dominate
# the KL term's gradient over the batch's other tokens.
K3_LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log π − log ref, (B, A) fp32."""
    return logp.float() - ref_logp.float()


def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """½ (log π − log ref)², (B, A) fp32."""
    return 0.5 * (logp.float() - ref_logp.float()) ** 2


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """clamp(e^x − x − 1, ±10) with x = log ref − log π clamped to ±20 (verl's low_var_kl), (B, A) fp32; ≥ 0 since
    e^x ≥ 1 + x."""
    log_ratio = (ref_logp.float() - logp.float()).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # (B, A)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_samples: int) -> None:
        del current_kl, n_samples

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        # The coefficient is config; a checkpoint that disagrees means the config changed mid-run.
        if float(state["value"]) != self.value:
            raise ValueError(f"the checkpoint's fixed KL coefficient is {state['value']}, the config's {self.value}; "
                             "a fixed coefficient cannot change on resume")


class AdaptiveKLController:
    """Ziegler et al. 2019: move the coefficient towards `target` KL, by at most ±20 % per `horizon` samples.

    error = clip(current_kl / target − 1, −0.2, 0.2);  value ← value · (1 + error · n_samples / horizon)
    exactly as TRL's old `AdaptiveKLController` (there `n_steps` is the batch size).
    """

    def __init__(self, init_coef: float, target: float, horizon: int):
        if not target > 0 or not horizon > 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_samples: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL controller got a non-finite KL {current_kl}")
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_samples / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def build_kl_controller(coef: float, target: float | None, horizon: int) -> FixedKLController | AdaptiveKLController:
    """Adaptive towards `target` when one is given, else fixed at `coef`."""
    if target is None:
        return FixedKLController(coef)
    return AdaptiveKLController(coef, target, horizon)
