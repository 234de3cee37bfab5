"""peft=lora's own config rules, and the backends and machines it needs; each problem names the field and the fix.
Called by validation.config_problems before any model loads (no peft import; torch only for the QLoRA CUDA check)."""

from __future__ import annotations

from typing import Any

from llmtrain.config import OUTPUT_LAYERS

PEFT_METHODS = ("none", "lora")


def peft_problems(peft: Any, backend: Any, adapter_reference_stage: str | None = None) -> list[str]:
    """peft=lora's own fields, and the backends it does not run on yet; each line names the field and the fix.
    `adapter_reference_stage`: the stage, if any, whose frozen reference is the policy with its adapters off."""
    if peft.name != "lora":
        return []
    problems = []
    if not peft.r >= 1:
        problems.append(f"peft.r={peft.r} must be >= 1 (the adapters' rank; typical 8-64)")
    if not peft.alpha > 0:
        problems.append(f"peft.alpha={peft.alpha} must be > 0 (the adapters' scale is alpha / r; typical 2·r)")
    if not 0 <= peft.dropout < 1:
        problems.append(f"peft.dropout={peft.dropout} must be in [0, 1)")
    targets = peft.target_modules
    if isinstance(targets, str):
        if targets != "all-linear":
            problems.append(f"peft.target_modules={targets!r} must be all-linear or a list of module names "
                            "(peft.target_modules=[q_proj,v_proj])")
    elif not targets or not all(isinstance(t, str) and t for t in targets):
        problems.append(f"peft.target_modules={targets!r} must be all-linear or a non-empty list of module names")
    elif any(t in OUTPUT_LAYERS for t in targets):
        problems.append(f"peft.target_modules: {', '.join(OUTPUT_LAYERS)} is the output layer, which LoRA leaves "
                        "alone: drop it from the list (or train it in full with peft.modules_to_save=[lm_head])")
    if adapter_reference_stage and peft.dropout > 0:
        problems.append(f"stage {adapter_reference_stage} with peft=lora takes its reference's log-probs from the "
                        "policy with adapters "
                        f"disabled (dropout off there), the policy's with peft.dropout={peft.dropout} on: the first "
                        "ratio would not be 1. Set peft.dropout=0")
    tp = getattr(backend, "tp", 1)  # the tensor-parallel degree, on every backend that has one (ParallelDims' name)
    if tp > 1:
        problems.append(f"peft=lora with backend.tp={tp}: the tensor-parallel plan does not map LoRA "
                        f"layers yet; use backend.tp=1 (backend={backend.name})")
    ep = getattr(backend, "ep", 1)
    if ep > 1:  # peft's prefix moves the experts' module paths, and adapters beside split experts are untested
        problems.append(f"peft=lora with backend.ep={ep}: LoRA beside experts split over ep ranks is not built or "
                        "tested yet; use backend.ep=1 (the experts FSDP-sharded whole)")
    return problems


def qlora_problems(cfg: Any, quantized_base_backends: tuple[str, ...]) -> list[str]:
    """peft.load_in_4bit=true (QLoRA): a CUDA GPU with bitsandbytes, a pretrained base, a backend that holds a 4-bit
    base (`quantized_base_backends`: llmtrain.backends.backends_that("loads_4bit_base")), bf16."""
    if cfg.peft.name != "lora" or not getattr(cfg.peft, "load_in_4bit", False):
        return []
    import importlib.util

    import torch

    problems = []
    if cfg.device == "cpu" or not torch.cuda.is_available():
        problems.append(f"peft.load_in_4bit=true (QLoRA) needs a CUDA GPU and bitsandbytes; this run has none "
                        f"(device={cfg.device}, torch.cuda.is_available()={torch.cuda.is_available()}): run it on a "
                        "GPU machine, or set peft.load_in_4bit=false (plain LoRA)")
    elif importlib.util.find_spec("bitsandbytes") is None:
        problems.append("peft.load_in_4bit=true (QLoRA) needs bitsandbytes: pip install bitsandbytes, or set "
                        "peft.load_in_4bit=false")
    if cfg.backend.name not in quantized_base_backends:
        names = "/".join(quantized_base_backends)
        problems.append(f"peft.load_in_4bit=true runs on backend={names} only (backend.name={cfg.backend.name}: "
                        f"sharding 4-bit weights is not wired up); use backend={names} or peft.load_in_4bit=false")
    if cfg.model.name_or_path is None:
        problems.append("peft.load_in_4bit=true quantizes pretrained weights: set model.name_or_path (a random init "
                        "from model.from_config has nothing to quantize)")
    if cfg.precision not in ("auto", "bf16"):
        problems.append(f"peft.load_in_4bit=true computes in bf16: precision={cfg.precision} must be bf16 or auto")
    return problems
