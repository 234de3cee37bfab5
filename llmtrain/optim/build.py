"""The one optimizer builder of every backend: `optim.name=adamw` -> torch.optim.AdamW over decay / no-decay groups;
`optim.name=muon` -> MuonAdamW: Muon for the hidden matrices, AdamW (optim.lr, optim.weight_decay) for embeddings,
the LM head, norms and biases (Moonlight's split). Group order: AdamW groups first, so `param_groups[0]["lr"]` (the
lr the trainer logs) stays optim.lr's schedule.
"""

from __future__ import annotations

from typing import Callable

import torch

from llmtrain.optim.muon import MuonAdamW
from llmtrain.optim.spec import MuonSpec


def shape_of(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3: the data is a 1-D shard, ds_shape the full


def adamw_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay on matrices (weights, embeddings), none on biases and norm scales (ndim < 2); empty groups left out
    (LoRA trains matrices only: DeepSpeed's ZeRO optimizers drop an empty group, and the scheduler would then step
    one lr more than there are groups)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if len(shape_of(p)) >= 2]
    no_decay = [p for p in params if len(shape_of(p)) < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def io_params(model: torch.nn.Module) -> set[int]:
    """ids of the input embedding and of the output heads' weights (the LM head, tied or not; a reward or value
    model's scalar head): AdamW's under Muon, as in Moonlight."""
    from llmtrain.models.heads import SCORE_LAYERS

    modules = [getattr(model, getter, lambda: None)() for getter in ("get_input_embeddings", "get_output_embeddings")]
    modules += [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in SCORE_LAYERS]
    return {id(p) for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters(recurse=False)}


def muon_params(model: torch.nn.Module, experts: str) -> tuple[list, list]:
    """(Muon's: the hidden 2-D matrices, and 3-D expert weights under experts=per_matrix; AdamW's: the rest)."""
    skip, muon, rest = io_params(model), [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        ndim = len(shape_of(param))
        hidden = id(param) not in skip and (ndim == 2 or (ndim == 3 and experts == "per_matrix"))
        (muon if hidden else rest).append(param)
    return muon, rest


def muon_group(params: list, spec: MuonSpec) -> dict:
    return {"params": params, "muon": True, "lr": spec.lr, "weight_decay": spec.weight_decay,
            "momentum": spec.momentum, "nesterov": spec.nesterov, "ns_coefficients": tuple(spec.ns_coefficients),
            "ns_steps": spec.ns_steps, "eps": spec.eps, "adjust_lr_fn": spec.adjust_lr_fn}


def build_optimizer(model: torch.nn.Module, spec, *, fused: bool = False,
                    split: Callable[[list[dict]], list[dict]] | None = None) -> torch.optim.Optimizer:
    """`spec`: backends.base.OptimizerSpec (its `muon`: a MuonSpec or None). `split`: a backend's further split of
    the groups (FSDP2 with tp: one group per DTensor mesh)."""
    split = split or (lambda groups: groups)
    adamw = {"lr": spec.lr, "betas": spec.betas, "eps": spec.eps, "fused": fused or None}
    if spec.muon is None:
        return torch.optim.AdamW(split(adamw_groups(list(model.parameters()), spec.weight_decay)), **adamw)
    muon, rest = muon_params(model, spec.muon.experts)
    if not muon:
        raise ValueError(f"optim=muon: {type(model).__name__} has no hidden matrix for Muon to update")
    groups = split(adamw_groups(rest, spec.weight_decay)) + split([muon_group(muon, spec.muon)])
    return MuonAdamW(groups, **adamw)
