"""One Engine per role of a stage, all built by the run's backend on its one ParallelDims and mesh.

Trainable roles get an optimizer (`wrap(model, spec)`), frozen ones `wrap(model, None)`. Each role is
built inside the backend's `model_init_context()` of its own (ZeRO-3's zero.Init, FSDP2's meta ranks), so
building one role never changes how the next is built. Random weights (from_config, a new head) come
from the seeded init: the same on every backend and world size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from llmtrain.backends.base import OptimizerSpec
from llmtrain.config import ConfigError
from llmtrain.models.load import build_model
from llmtrain.models.lora import LoraSettings
from llmtrain.stages.base import RoleSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelOptions:
    """How every role's model is built (plain values from `model.*`)."""
    attn_implementation: str
    dropout: float
    activation_checkpointing: bool
    fused_head_chunk: int | None = None  # the fused LM head and loss (0: default chunk size); None: full logits
    fused_head_kernel: str = "chunked"  # its summed loss: "chunked" or "liger" (models/liger.py)


def check_same_data_parallel(layouts: dict[str, tuple[int, int]]) -> None:
    """Every role must read the same examples on a rank: equal (dp_size, dp_rank) for all roles."""
    if len(set(layouts.values())) > 1:
        described = ", ".join(f"{role}: dp size {size}, dp rank {rank}" for role, (size, rank) in layouts.items())
        raise ConfigError(f"the roles of this stage do not share one data-parallel layout ({described}); give every "
                          "role the same backend degrees (backend.dp_replicate / dp_shard / tp)")


def adapter_off_engine(role: str, target: str, engines: dict):
    from llmtrain.backends.adapter_off import AdapterOffEngine

    if target not in engines:
        raise ValueError(f"role {role!r} is role {target!r} with its adapters disabled, but {target!r} is not built "
                         f"before it: list {target!r} first in the stage's roles (built: {sorted(engines)})")
    if engines[target].ctx.is_main:
        log.info("%s: the %s with adapters disabled (no second copy of the base)", role, target)
    return AdapterOffEngine(engines[target], target)


def build_engines(roles: dict[str, RoleSpec], backend, tokenizer, options: ModelOptions, seed: int,
                  optim: OptimizerSpec, lora: LoraSettings | None = None) -> dict:
    """`lora`: adapters on every trainable role. A frozen role with `adapter_off_of` is then that role's model
    with its adapters disabled (built first: roles are built in their dict order); other frozen roles stay plain."""
    engines = {}
    for role, spec in roles.items():
        if lora is not None and spec.adapter_off_of:
            engines[role] = adapter_off_engine(role, spec.adapter_off_of, engines)
            continue
        src = spec.source
        with backend.model_init_context():
            model = build_model(name_or_path=src.name_or_path, from_config=src.from_config,
                                config_path=src.config_path, tokenizer=tokenizer,
                                attn_implementation=options.attn_implementation, dropout=options.dropout,
                                activation_checkpointing=options.activation_checkpointing and spec.trainable,
                                trust_remote_code=src.trust_remote_code, head=spec.head, seed=seed,
                                gather=backend.gathered_for_init, lora=lora if spec.trainable else None,
                                fused_head_chunk=options.fused_head_chunk,
                                fused_head_kernel=options.fused_head_kernel)
        role_optim = replace(optim, lr=spec.lr) if spec.lr is not None else optim
        engines[role] = backend.wrap(model, role_optim if spec.trainable else None)
        log.debug("role %s: %s, %s", role, type(model).__name__, "trainable" if spec.trainable else "frozen")
    check_same_data_parallel({role: (e.dp_size, e.dp_rank) for role, e in engines.items()})
    # The training RNG stream starts here, the same on every backend: building drew from it in
    # backend-specific ways (zero.Init, meta ranks), and the seeded init draws from generators of its own.
    torch.manual_seed(seed)
    return engines
