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


def check_same_data_parallel(layouts: dict[str, tuple[int, int]]) -> None:
    """Every role must read the same examples on a rank: equal (dp_size, dp_rank) for all roles."""
    if len(set(layouts.values())) > 1:
        described = ", ".join(f"{role}: dp size {size}, dp rank {rank}" for role, (size, rank) in layouts.items())
        raise ConfigError(f"the roles of this stage do not share one data-parallel layout ({described}); give every "
                          "role the same backend degrees (backend.dp_replicate / dp_shard / tp)")


def build_engines(roles: dict[str, RoleSpec], backend, tokenizer, options: ModelOptions, seed: int,
                  optim: OptimizerSpec, lora: LoraSettings | None = None) -> dict:
    """`lora`: adapters on every trainable role (frozen roles stay plain: a reference is the base itself)."""
    engines = {}
    for role, spec in roles.items():
        src = spec.source
        with backend.model_init_context():
            model = build_model(name_or_path=src.name_or_path, from_config=src.from_config,
                                config_path=src.config_path, tokenizer=tokenizer,
                                attn_implementation=options.attn_implementation, dropout=options.dropout,
                                activation_checkpointing=options.activation_checkpointing and spec.trainable,
                                trust_remote_code=src.trust_remote_code, head=spec.head, seed=seed,
                                gather=backend.gathered_for_init, lora=lora if spec.trainable else None)
        role_optim = replace(optim, lr=spec.lr) if spec.lr is not None else optim
        engines[role] = backend.wrap(model, role_optim if spec.trainable else None)
        log.debug("role %s: %s, %s", role, type(model).__name__, "trainable" if spec.trainable else "frozen")
    check_same_data_parallel({role: (e.dp_size, e.dp_rank) for role, e in engines.items()})
    # The training RNG stream starts here, the same on every backend: building drew from it in
    # backend-specific ways (zero.Init, meta ranks), and the seeded init draws from generators of its own.
    torch.manual_seed(seed)
    return engines
