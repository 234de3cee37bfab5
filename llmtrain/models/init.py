"""Seeded random init that does not depend on the backend, the world size or the order of RNG draws.

Building a model draws its random init from the global RNG in construction order, and that order is
not the same everywhere: DeepSpeed's `zero.Init` builds and partitions module by module, FSDP2's other
ranks build on the meta device, and a new head or adapter is added to an already-built model. So the
same seed gave other weights under ZeRO-3 than under DDP. Here every module's own parameters are drawn
with the model's own `_init_weights` (the family's distribution: normal(0, initializer_range) for
Linear and Embedding, ones for norms, ...) from a CPU generator seeded by (seed, module name): the
weights are a pure function of the seed and the architecture. Under ZeRO-3 each module is gathered
whole while it is written (`gather`, the backend's `gathered_for_init`), one module at a time, so no
rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Iterable

import torch

Gather = Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager]


def module_seed(seed: int, module_name: str) -> int:
    """A 63-bit seed from (seed, module name): stable across processes, Python versions and platforms."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _full_shape(param: torch.nn.Parameter) -> torch.Size:
    return getattr(param, "ds_shape", None) or param.shape  # ZeRO-3: the data is a shard outside a gather


def seeded_init(model: torch.nn.Module, seed: int, modules: Iterable[str] | None = None,
                gather: Gather = lambda params: contextlib.nullcontext()) -> list[str]:
    """Re-initialise the own parameters of every module (or of the named `modules`) from (seed, name).

    Values are drawn on the CPU in fp32 with the model's `_init_weights` applied to fresh tensors (holding the
    constructor's values, which stay where it draws nothing), then copied into the parameters (whatever their
    device, dtype or sharding). Modules on the meta device (FSDP2's ranks other than 0) are skipped: they receive
    rank 0's values. Returns the names initialised.
    """
    wanted = None if modules is None else set(modules)
    done = []
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own or (wanted is not None and name not in wanted):
            continue
        if any(param.is_meta for param in own.values()):
            continue
        with gather(list(own.values())):
            fresh = _drawn(model, module, own, module_seed(seed, name))
            with torch.no_grad():
                for key, param in own.items():
                    param.copy_(fresh[key].to(param.device, param.dtype))
        done.append(name)
    return done


def _drawn(model: torch.nn.Module, module: torch.nn.Module, own: dict, seed: int) -> dict[str, torch.Tensor]:
    """The module's init drawn into fresh CPU fp32 tensors (swapped in for the call, then swapped back)."""
    fresh = {key: torch.nn.Parameter(_constructed(p), requires_grad=False) for key, p in own.items()}
    original = {key: module._parameters[key] for key in own}
    module._parameters.update(fresh)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            init_weights_of(model)(module)
    finally:
        module._parameters.update(original)
    return {key: value.detach() for key, value in fresh.items()}


def _constructed(param: torch.nn.Parameter) -> torch.Tensor:
    """A CPU fp32 copy of the parameter's value from the module's constructor, where `_init_weights` draws nothing
    (Apertus's xIELU alpha_p / alpha_n: a torch.empty there would leave memory garbage, or zeros that stop every
    gradient); a shard outside a gather has no whole value to copy."""
    if param.shape != _full_shape(param):
        return torch.empty(_full_shape(param), dtype=torch.float32)
    return param.detach().to("cpu", torch.float32, copy=True)


def init_weights_of(model: torch.nn.Module) -> Callable[[torch.nn.Module], None]:
    """The Hugging Face model's per-module init (PreTrainedModel._init_weights); a plain module: reset_parameters."""
    init = getattr(model, "_init_weights", None)
    if init is not None:
        return init
    return lambda module: module.reset_parameters() if hasattr(module, "reset_parameters") else None


def missing_modules(missing_keys: Iterable[str]) -> set[str]:
    """Module names owning the parameters `from_pretrained` did not find (a new head, say)."""
    return {key.rpartition(".")[0] for key in missing_keys}
