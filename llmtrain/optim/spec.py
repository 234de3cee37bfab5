"""What `optim.name` means to the rest of the program, in pure Python (no torch): the Muon settings the builder
takes, the config checks, and the planner's optimizer-state bytes per parameter (Muon's gather:
metrics/cost.muon_gathers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPTIMIZERS = ("adamw", "muon")
ADJUST_LR = ("match_rms_adamw", "original")
EXPERTS = ("per_matrix", "adamw")  # a 3-D MoE weight (E, m, n): Muon per expert matrix, or AdamW
# The backends whose Muon update is exact against one-process torch.optim.Muon (tests/dist), by backend.name.
MUON_FIX = "use optim=adamw, or"  # how each refusal of Muon starts its fix


@dataclass(frozen=True)
class MuonSpec:
    """torch.optim.Muon's arguments for the hidden matrices; lr and weight_decay resolved (None: AdamW's)."""
    lr: float
    weight_decay: float
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    adjust_lr_fn: str = "match_rms_adamw"
    experts: str = "per_matrix"


def muon_spec(optim: Any) -> MuonSpec | None:
    """The MuonSpec of an `optim` config node (None under optim.name=adamw)."""
    if optim.name != "muon":
        return None
    m = optim.muon
    return MuonSpec(lr=optim.lr if m.lr is None else m.lr,
                    weight_decay=optim.weight_decay if m.weight_decay is None else m.weight_decay,
                    momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
                    ns_coefficients=tuple(m.ns_coefficients), eps=m.eps, adjust_lr_fn=m.adjust_lr_fn,
                    experts=m.experts)


def optim_problems(cfg: Any) -> list[str]:
    """optim.name and optim.muon.*, and the layouts Muon is not exact on; each line names the field and the fix."""
    o = cfg.optim
    if o.name not in OPTIMIZERS:
        return [f"optim.name={o.name!r} is not one of {', '.join(OPTIMIZERS)}"]
    if o.name != "muon":
        return []
    m, problems = o.muon, []
    if not 0 <= m.momentum < 1:
        problems.append(f"optim.muon.momentum={m.momentum} must be in [0, 1)")
    if not 1 <= m.ns_steps < 100:
        problems.append(f"optim.muon.ns_steps={m.ns_steps} must be in [1, 100) (torch.optim.Muon's bound)")
    if len(m.ns_coefficients) != 3:
        problems.append(f"optim.muon.ns_coefficients={list(m.ns_coefficients)} must be three numbers (a, b, c)")
    if not m.eps > 0:
        problems.append(f"optim.muon.eps={m.eps} must be > 0")
    if m.lr is not None and not m.lr > 0:
        problems.append(f"optim.muon.lr={m.lr} must be > 0, or null (optim.lr)")
    if m.weight_decay is not None and m.weight_decay < 0:
        problems.append(f"optim.muon.weight_decay={m.weight_decay} must be >= 0, or null (optim.weight_decay)")
    if m.adjust_lr_fn not in ADJUST_LR:
        problems.append(f"optim.muon.adjust_lr_fn={m.adjust_lr_fn!r} is not one of {', '.join(ADJUST_LR)} "
                        "(match_rms_adamw: the AdamW lr carries over)")
    if m.experts not in EXPERTS:
        problems.append(f"optim.muon.experts={m.experts!r} is not one of {', '.join(EXPERTS)}")
    return problems + _layout_problems(cfg)


def _layout_problems(cfg: Any) -> list[str]:
    """What Muon needs of the rest of the run beyond the backend (each backend's: BackendSpec.optimizer_problems)."""
    if getattr(cfg.peft, "name", "none") != "none":
        return [f"optim=muon with peft={cfg.peft.name}: Muon on low-rank adapter factors is not the Moonlight recipe "
                f"and is not tested: {MUON_FIX} peft=none"]
    return []


# ---- the planner's figures ----------------------------------------------------------------------------------------

def state_floats_per_param(name: str, muon_share: float = 0.0) -> float:
    """fp32 optimizer-state values per trainable parameter: AdamW 2 (exp_avg, exp_avg_sq); Muon 1 (momentum) on the
    fraction `muon_share` of parameters it updates, AdamW's 2 on the rest."""
    if name == "adamw":
        return 2.0
    if name == "muon":
        return 1.0 * muon_share + 2.0 * (1.0 - muon_share)
    raise ValueError(f"optim.name={name!r} is not one of {', '.join(OPTIMIZERS)}")


def optimizer_state_bytes(name: str, params: float, muon_params: float = 0.0, shards: int = 1) -> float:
    """Bytes of optimizer state one rank holds: `params` trainable parameters, `muon_params` of them updated by
    Muon, the state split over `shards` ranks (ZeRO-1/2/3, FSDP2: dp; DDP: 1)."""
    share = muon_params / params if params else 0.0
    return 4.0 * state_floats_per_param(name, share) * params / shards
