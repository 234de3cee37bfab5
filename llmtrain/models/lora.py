"""LoRA through the peft library: adapters on a built model, their seeded init, and the two exports.

No LoRA layer is written here: `get_peft_model(model, LoraConfig(...))` adds them, and freezes the base.
Only the init of A is ours: peft draws it (kaiming-uniform, B = 0) from the global RNG in construction
order, which is not the same on every backend (FSDP2's meta ranks draw nothing); here each lora_A is drawn
from a generator seeded by (seed, module name), as `models/init.py` does for the base, so the adapters are
the same on every backend and world size. B stays 0: step-0 logits equal the base's.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from llmtrain.config import ConfigError
from llmtrain.models.init import Gather, _full_shape, module_seed

log = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"
# What a head needs besides the adapters when peft.modules_to_save is null: a new score head is random, so
# it is trained in full; a causal LM's head is the (frozen) output layer.
DEFAULT_MODULES_TO_SAVE = {"lm": (), "scalar": ("score",)}


@dataclass(frozen=True)
class LoraSettings:
    """peft=lora as plain values (config stops at builders)."""
    r: int
    alpha: float
    dropout: float
    target_modules: str | tuple[str, ...]  # "all-linear" or module names
    modules_to_save: tuple[str, ...] | None  # None: the head decides (DEFAULT_MODULES_TO_SAVE)
    load_in_4bit: bool = False  # QLoRA (CUDA + bitsandbytes, checked in models/lora_checks.qlora_problems)

    @classmethod
    def from_config(cls, peft_cfg) -> LoraSettings | None:
        if peft_cfg.name != "lora":
            return None
        targets = peft_cfg.target_modules
        saved = peft_cfg.modules_to_save
        return cls(r=int(peft_cfg.r), alpha=float(peft_cfg.alpha), dropout=float(peft_cfg.dropout),
                   target_modules=targets if isinstance(targets, str) else tuple(targets),
                   modules_to_save=None if saved is None else tuple(saved),
                   load_in_4bit=bool(getattr(peft_cfg, "load_in_4bit", False)))


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PeftModel (what `decoder_blocks` and TP plans look into); else the model."""
    return model.get_base_model() if is_peft(model) else model


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _check_names(model: torch.nn.Module, settings: LoraSettings, saved: tuple[str, ...]) -> None:
    """Every listed name must match a module (peft itself only complains when none does)."""
    linear = _linear_names(model)
    if settings.target_modules != ALL_LINEAR:
        missing = [t for t in settings.target_modules if t not in linear]
        if missing:
            raise ConfigError(f"peft.target_modules: {', '.join(missing)} match no linear layer of "
                              f"{type(model).__name__} (its linear layers: {', '.join(sorted(linear))})")
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    missing = [s for s in saved if s not in names]
    if missing:
        raise ConfigError(f"peft.modules_to_save: {', '.join(missing)} is no module of {type(model).__name__}; "
                          "give module names (score, lm_head, ...) or null")


def apply_lora(model: torch.nn.Module, settings: LoraSettings, *, head: str, seed: int,
               gather: Gather) -> torch.nn.Module:
    """The model wrapped by peft (base frozen, adapters trainable), A drawn from (seed, module name)."""
    from peft import LoraConfig, get_peft_model

    saved = settings.modules_to_save if settings.modules_to_save is not None else DEFAULT_MODULES_TO_SAVE[head]
    _check_names(model, settings, saved)
    targets = settings.target_modules if settings.target_modules == ALL_LINEAR else list(settings.target_modules)
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, modules_to_save=list(saved) or None, bias="none")
    with torch.random.fork_rng(devices=[]):  # peft's own draws are replaced below: they must not shift the RNG
        peft_model = get_peft_model(model, config)
    seeded_lora_init(peft_model, seed, gather)
    log_trainable(peft_model, settings.r)
    return peft_model


# ---- QLoRA (CUDA only; written against transformers 5 / peft 0.21 / bitsandbytes, not run on the CPU machine) ----

def quantized_load_kwargs() -> dict:
    """from_pretrained arguments for a 4-bit NF4 base computing in bf16, on this rank's GPU."""
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_compute_dtype=torch.bfloat16),
            "device_map": {"": torch.cuda.current_device()}}


def prepare_quantized(model: torch.nn.Module, activation_checkpointing: bool) -> torch.nn.Module:
    """peft's preparation of a k-bit base: norms in fp32, input grads on, checkpointing (non-reentrant) if asked."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=activation_checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


def is_quantized(model: torch.nn.Module) -> bool:
    return bool(getattr(unwrap_peft(model), "is_loaded_in_4bit", False))


def lora_layers(model: torch.nn.Module):
    """(name, LoraLayer) for every adapted module."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def seeded_lora_init(model: torch.nn.Module, seed: int, gather: Gather) -> None:
    """peft's init (A kaiming-uniform with a = √5, B = 0), A drawn from (seed, module name) on the CPU in fp32.
    Modules on the meta device (FSDP2's ranks other than 0) are skipped: they receive rank 0's values."""
    for name, layer in lora_layers(model):
        for adapter, linear_a in layer.lora_A.items():
            params = [linear_a.weight, layer.lora_B[adapter].weight]
            if any(p.is_meta for p in params):
                continue
            fresh = torch.empty(_full_shape(linear_a.weight), dtype=torch.float32)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(seed, f"{name}.lora_A.{adapter}"))
                torch.nn.init.kaiming_uniform_(fresh, a=math.sqrt(5))
            with gather(params), torch.no_grad():
                params[0].copy_(fresh.to(params[0].device, params[0].dtype))
                params[1].zero_()


def adapter_formula(model: torch.nn.Module, r: int) -> tuple[int, int]:
    """(Σ r·(d_in + d_out) over the adapted matrices, their number)."""
    layers = lora_layers(model)
    return sum(r * (layer.in_features + layer.out_features) for _, layer in layers), len(layers)


def count_trainable(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters); ZeRO-3 shards count whole (ds_numel)."""
    numel = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(n for n, grad in numel if grad), sum(n for n, _ in numel)


def modules_to_save_numel(model: torch.nn.Module) -> int:
    """Parameters trained in full next to the adapters (peft's modules_to_save copies)."""
    return sum(getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters()
               if ".modules_to_save." in n and p.requires_grad)


def log_trainable(model: torch.nn.Module, r: int) -> None:
    trainable, total = count_trainable(model)
    formula, matrices = adapter_formula(model, r)
    saved = modules_to_save_numel(model)
    log.info("lora: %d trainable parameters of %d (%.2f%%); Σ r·(d_in + d_out) over %d adapted matrices = %d, "
             "modules_to_save %d", trainable, total, 100 * trainable / max(total, 1), matrices, formula, saved)
    if trainable != formula + saved:
        log.warning("lora: trainable %d != Σ r·(d_in + d_out) %d + modules_to_save %d", trainable, formula, saved)


# ---- export: from the full state dict, on one process ---------------------------------------------

def _plain_class(module: torch.nn.Module) -> type:
    """The transformers class under FSDP2's per-instance subclass (FSDPLlamaForCausalLM -> LlamaForCausalLM)."""
    return next(c for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))


def fresh_copy(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU PeftModel of the same architecture and adapters holding `state` (the full, gathered weights).
    Built apart from the training model, whose weights may be shards (FSDP2 DTensors, ZeRO-3 partitions)
    that peft's merge would edit without gathering them."""
    from peft import get_peft_model

    base = unwrap_peft(model)
    config = copy.deepcopy(model.peft_config["default"])
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        fresh = _plain_class(base)(copy.deepcopy(base.config))
        fresh = get_peft_model(fresh, config)
    fresh.load_state_dict(state, strict=True)
    return fresh.eval()


def check_whole_adapters(state: dict[str, torch.Tensor]) -> None:
    """Every LoRA matrix in a state dict about to be saved is whole: 2-D and non-empty. A ZeRO-3 partition or an
    FSDP2 shard saved without gathering is empty or flat (a known way to write adapters that load as zeros)."""
    bad = [f"{name} {tuple(t.shape)}" for name, t in state.items()
           if ("lora_A" in name or "lora_B" in name) and (t.ndim != 2 or t.numel() == 0)]
    if bad:
        raise RuntimeError(f"lora export: {len(bad)} adapter tensors are not whole matrices (not gathered?): "
                           f"{', '.join(bad[:4])}")


def save_quantized_adapter_and_merged(model: torch.nn.Module, hf_dir: Path, adapter_dir: Path) -> None:
    """QLoRA: adapter/ from the model itself (whole on DDP); hf/ merged into the base reloaded unquantized (fp32,
    CPU) from where it came, not into 4-bit weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model.save_pretrained(adapter_dir, safe_serialization=True)
    source = unwrap_peft(model).config._name_or_path
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, device_map={"": "cpu"})
    PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(hf_dir, safe_serialization=True)
    log.info("qlora: adapters in %s, merged into the fp32 base from %s in %s", adapter_dir, source, hf_dir)


def save_adapter_and_merged(model: torch.nn.Module, state: dict[str, torch.Tensor], hf_dir: Path,
                            adapter_dir: Path) -> None:
    """`adapter_dir`: peft format (PeftModel.from_pretrained(base, adapter_dir) loads it); `hf_dir`: the base
    with the adapters merged in (a plain transformers folder). Rank 0 only, from the full (gathered) state dict,
    merged in a fresh single-process copy: peft's merge edits `base_layer.weight` in place, which under ZeRO-3 or
    FSDP2 is a partition or a shard."""
    if is_quantized(model):
        save_quantized_adapter_and_merged(model, hf_dir, adapter_dir)
        return
    check_whole_adapters(state)
    fresh = fresh_copy(model, state)
    fresh.peft_config["default"].base_model_name_or_path = getattr(unwrap_peft(model).config, "_name_or_path", None)
    fresh.save_pretrained(adapter_dir, safe_serialization=True)
    merged = fresh.merge_and_unload()
    merged.save_pretrained(hf_dir, safe_serialization=True)
    log.info("lora: adapters in %s, merged model in %s", adapter_dir, hf_dir)


def adapter_dir_for(hf_dir: Path) -> Path:
    """hf/ -> adapter/, reward_hf/ -> reward_adapter/: where a role's adapters go next to its merged export."""
    name = hf_dir.name
    return hf_dir.with_name(name[: -len("hf")] + "adapter" if name.endswith("hf") else name + "_adapter")
