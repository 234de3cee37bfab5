"""Liger Kernel's fused linear cross-entropy (Triton, CUDA) for the causal-LM sum, as the fused head's kernel.

`model.fused_loss=liger` (or `auto` where it can run) computes the summed loss −Σ log p of pretrain and SFT with
Liger's `liger_fused_linear_cross_entropy` (reduction "sum", ignore_index −100, the family's final-logit softcap),
which, like the chunked path (models/fused_head.py), computes each chunk's gradient in the forward. It returns the
loss only: per-token log-probs (eval, DPO/SimPO/ORPO, PPO/GRPO), entropy, a temperature and a head split over the
vocabulary (backend.tp > 1, models/vocab_parallel.py) are not what its kernel computes. So:
- `auto` picks Liger on a CUDA device where `liger_kernel` is installed, for a stage whose trained loss is the
  causal-LM sum, without tp; everywhere else the chunked path;
- an explicit `liger` that cannot run is refused before any model loads (`liger_problems`), each line naming the fix;
- under `liger` the stage's eval (per-token log p and argmax hits, no gradients) still runs the chunked path.
liger-kernel is an optional extra (`pip install 'llmtrain[liger]'`), never required.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch

from llmtrain.losses.lm import IGNORE_INDEX

INSTALL_HINT = "pip install 'llmtrain[liger]'"
KERNELS = ("chunked", "liger")  # what the fused head runs its summed loss with


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_problems(device_type: str, tp: int, stage: str, lm_loss_sum: bool, installed: bool) -> list[str]:
    """Why Liger's kernel cannot compute this run's head (empty: it can), each naming the fix."""
    problems = []
    if device_type != "cuda":
        problems.append(f"model.fused_loss=liger: Liger Kernel runs on CUDA GPUs only, this run's device is "
                        f"{device_type}; set model.fused_loss=chunked (or auto, which picks chunked there)")
    elif not installed:
        problems.append(f"model.fused_loss=liger: liger_kernel is not installed; {INSTALL_HINT}, or set "
                        "model.fused_loss=chunked")
    if tp > 1:
        problems.append(f"model.fused_loss=liger: backend.tp={tp} splits the LM head over the vocabulary, which "
                        "Liger's kernel does not do; set model.fused_loss=chunked (the vocab-parallel chunked head) or "
                        "backend.tp=1")
    if not lm_loss_sum:
        problems.append(f"model.fused_loss=liger: stage {stage} trains on per-token log-probs, which Liger's fused "
                        "linear cross-entropy does not return (it returns the summed loss); set "
                        "model.fused_loss=chunked (or auto)")
    return problems


def head_kernel(fused_loss: str, device_type: str, tp: int, stage: str, lm_loss_sum: bool,
                installed: bool) -> tuple[str | None, str]:
    """model.fused_loss -> (the fused head's kernel: "chunked" | "liger", None for full logits; why)."""
    if fused_loss == "off":
        return None, "model.fused_loss=off: full (tokens, V) logits"
    if fused_loss in KERNELS:
        return fused_loss, f"model.fused_loss={fused_loss}"
    problems = liger_problems(device_type, tp, stage, lm_loss_sum, installed)
    if not problems:
        return "liger", "model.fused_loss=auto: Liger Kernel on CUDA for the causal-LM sum"
    return "chunked", "model.fused_loss=auto: chunked (Liger not used: " + problems[0].split(": ", 1)[1] + ")"


def fused_loss_problems(cfg: Any, device_type: str, lm_loss_sum: bool) -> list[str]:
    """An explicit model.fused_loss=liger this run cannot honour (validation, before any model loads)."""
    if cfg.model.fused_loss != "liger":
        return []
    tp = getattr(cfg.backend, "tp", 1) or 1
    return liger_problems(device_type, tp, cfg.stage.name, lm_loss_sum, liger_installed())


def liger_loss_rows(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    softcap: float | None, dtype: torch.dtype) -> torch.Tensor:
    """hidden (N, h), weight (V, h), bias (V,) | None, targets (N,) -> (N, 3) fp32 in the fused head's layout: zeros
    (Liger returns no per-token log p or entropy), and at [0, 2] the summed loss −Σ log p with its gradient. `dtype`:
    the head's compute dtype (autocast's), both operands cast to it as the model's matmul would."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    options = {"accum_dtype": torch.float32} if "accum_dtype" in _parameters() else {}  # fp32 weight gradients
    loss = liger_fused_linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets,
                                            bias=None if bias is None else bias.to(dtype), ignore_index=IGNORE_INDEX,
                                            reduction="sum", softcap=softcap, **options)
    rows = torch.zeros(hidden.shape[0], 3, dtype=torch.float32, device=hidden.device)
    rows[0, 2] = loss.float()
    return rows


def _parameters() -> set[str]:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return set(inspect.signature(liger_fused_linear_cross_entropy).parameters)
