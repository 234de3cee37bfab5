"""What a backend is to the rest of the program: one descriptor (`BackendSpec`) per backend, registered in
`llmtrain.backends.BACKENDS`. Its typed config group, its checks, its layout on ParallelDims (its degrees are the
`backend.<dimension>` fields its config class has: parallel/), its planner figures
and what it supports live with it (`backends/<name>_spec.py`), so nothing outside backends/ names a backend.

Pure Python: a descriptor module never imports torch.distributed, DeepSpeed or the engine (`engine` is a lazy
"module:Class" path), so the config checks and the planner run without a backend library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from llmtrain.parallel import ParallelDims


def no_problems(*args: Any) -> list[str]:
    return []


def no_gathers(layout: Any, facts: Any) -> tuple[int, float | None]:
    """(parameters gathered whole at once, parameters gathered again in backward) of a role whose blocks are not
    all-gathered: the planner's working set is two blocks and the largest other module; nothing regathered."""
    return 2 * facts.block + max(facts.embed, facts.head), None


@dataclass(frozen=True)
class BackendSpec:
    """One backend, everything the program asks about it."""
    name: str  # `backend.name`, the registry key
    engine: str  # "module:Class" of its Backend (imported only when a run builds it)
    config_class: type  # the typed config group of its fields only (Hydra: group backend, `<name>_schema`)
    presets: tuple[str, ...]  # the conf/backend/*.yaml that choose it (the first: plain `backend=<name>`)
    compared: tuple[str, ...]  # the presets the planner's plan.compare_backends table has a row for
    # (row name, backend cfg, ParallelDims, hidden size) -> metrics.cost.Layout
    layout: Callable[..., Any]
    # (backend cfg) -> the planner row's name (the preset it is: zero3_offload, fsdp2_tp, ...)
    row_name: Callable[[Any], str]
    # metrics/cost.py's figures as this backend holds and moves a role:
    # (RoleParams, Layout, precision, grad_accum_steps, on_gpu) -> StateBytes
    holdings: Callable[..., Any]
    # (RoleParams, Layout, precision, accum, on_gpu) -> [Collective] of one optimizer step (TP's added by cost.py)
    collectives: Callable[..., Any]
    # (backend cfg, world size) -> problems, each naming the field and the fix; pure Python, nothing loaded
    problems: Callable[[Any, int], list[str]] = no_problems
    # (Layout, ModelFacts) -> (parameters gathered whole at once, parameters gathered again in backward or None)
    gathers: Callable[[Any, Any], tuple[int, float | None]] = no_gathers
    # (backend cfg, run cfg) -> what this backend cannot run of the run's optim group (Muon's layouts), naming the fix
    optimizer_problems: Callable[[Any, Any], list[str]] = no_problems
    frozen_in_compute_dtype: bool = False  # a frozen role's weights in bf16/fp16 (else fp32)
    loads_4bit_base: bool = False  # QLoRA: holds a bitsandbytes 4-bit frozen base (sharding one is not wired up)
    no_async_save: str = ""  # why trainer.async_save=true cannot run on it ("": it can: save_checkpoint_async)
    updates_in_clip: bool = False  # clip_or_fused_step applies the update: no skip once the loss is known

    def fields(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.config_class))

    def parallel_dims(self, backend: Any, world_size: int) -> ParallelDims:
        """The run's layout: ConfigError (every degree named) when the degrees do not fit the world."""
        return ParallelDims.of(backend, world_size)

    def config_from_options(self, options: dict) -> Any:
        """The typed config from a plain dict (build_backend's options; missing fields take their defaults)."""
        known = set(self.fields())
        return self.config_class(**{k: v for k, v in options.items() if k in known})

    def presets_hint(self) -> str:
        """How to choose it: `backend=deepspeed/zero0/zero1/...`."""
        return "backend=" + "/".join(self.presets)
