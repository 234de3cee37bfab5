"""The backend registry: one descriptor (`BackendSpec`, backends/spec.py) per backend, by name. Everything the rest
of the program asks about a backend goes through here, so no backend's name appears outside backends/.

Light on purpose: the descriptors (backends/<name>_spec.py) are pure Python; an engine module (ddp.py, fsdp2.py,
deepspeed.py, which with its checkpoints' half deepspeed_checkpoint.py imports deepspeed) is imported only when
`build_backend` builds it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from llmtrain.backends import ddp_spec, deepspeed_spec, fsdp2_spec
from llmtrain.backends.spec import BackendSpec
from llmtrain.distributed import DistContext
from llmtrain.parallel import DIMENSIONS, PLANNED, ParallelDims, degrees_of
from llmtrain.parallel.dimension import carved_dimensions, mesh_order

BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in (ddp_spec.SPEC, deepspeed_spec.SPEC, fsdp2_spec.SPEC)}


def backend_spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def spec_of(backend: Any) -> BackendSpec | None:
    """The descriptor of a backend config node: the one whose typed group it was composed from (a composed config),
    else the one it names; None for an unknown name (reported by the choice check)."""
    chosen = _group_spec(backend)
    return chosen if chosen is not None else BACKENDS.get(getattr(backend, "name", None))


def _group_spec(backend: Any) -> BackendSpec | None:
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(backend, DictConfig):
        return next((s for s in BACKENDS.values() if type(backend) is s.config_class), None)
    return next((s for s in BACKENDS.values() if OmegaConf.get_type(backend) is s.config_class), None)


def build_backend(name: str, ctx: DistContext, precision: str, options: dict | None = None):
    """`options`: the backend config as a plain dict (cfg.backend); a backend reads the fields it owns, and builds
    the run's one ParallelDims (`dims_for`)."""
    module_name, class_name = backend_spec(name).engine.split(":")
    return getattr(importlib.import_module(module_name), class_name)(ctx, precision, options or {})


def dims_for(name: str, options: dict, ctx: DistContext) -> ParallelDims:
    """The run's layout for a backend object: from its options, on this run's device (meshes built on first use)."""
    spec = backend_spec(name)
    return spec.parallel_dims(spec.config_from_options(options), ctx.world_size).on(ctx.device.type)


def register_schemas() -> None:
    """Each backend's typed group in Hydra's ConfigStore: conf/backend/<preset>.yaml starts from `<name>_schema`."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for spec in BACKENDS.values():
        store.store(group="backend", name=f"{spec.name}_schema", node=spec.config_class)


# ---- checks: pure Python, before anything loads ---------------------------------------------------------------

def backend_problems(backend: Any, world_size: int) -> list[str]:
    """The chosen backend's own checks; each line names the field and the fix."""
    group, named = _group_spec(backend), BACKENDS.get(backend.name)
    if group is not None and named is not None and named is not group:
        return [f"backend.name={backend.name} does not change the backend group ({group.name}'s fields): choose "
                f"the backend with backend={backend.name}, not backend.name"]
    if group is not None:  # `+backend.KEY=...` appends to a typed group: refused here by name
        extra = [key for key in backend if key not in group.fields()]
        if extra:
            return [_misplaced(key, f"backend.{key}", group) for key in extra]
    if named is None:
        return []
    return ParallelDims.problems(world_size, backend, **degrees_of(backend)) + named.problems(backend, world_size)


def backend_model_problems(backend: Any, world_size: int, load_arch: Callable[[], Any]) -> list[str]:
    """What the run's parallel dimensions need from the model's architecture config (config.json, no weights), read
    by `load_arch()` only when a dimension that checks it is set (ParallelDims.model_problems)."""
    if spec_of(backend) is None or backend_problems(backend, world_size):
        return []
    return ParallelDims.of(backend, world_size).model_problems(backend, load_arch)


def backend_plan_problems(backend: Any, world_size: int, facts: Any) -> list[str]:
    """backend_model_problems on the planner's model facts (models/facts.ModelFacts: no transformers config)."""
    if spec_of(backend) is None or backend_problems(backend, world_size):
        return []
    return ParallelDims.of(backend, world_size).facts_problems(backend, facts)


def data_parallel_size(backend: Any, world_size: int) -> int:
    """Ranks that see different data (ParallelDims.data_parallel_size)."""
    return ParallelDims.data_parallel_size(degrees_of(backend), world_size)


def backends_that(capability: str) -> tuple[str, ...]:
    """The backends whose descriptor has `capability` (a BackendSpec flag, e.g. "loads_4bit_base")."""
    return tuple(name for name, spec in BACKENDS.items() if getattr(spec, capability))


def compared_presets() -> tuple[str, ...]:
    """The planner's plan.compare_backends rows, backend by backend."""
    return tuple(preset for spec in BACKENDS.values() for preset in spec.compared)


# ---- a key of another backend's group ------------------------------------------------------------------------

def misplaced_key_message(error: BaseException) -> str | None:
    """The project's message for a `backend.KEY` the chosen backend's group has not (Hydra/OmegaConf's error, or one
    it caused): which backend has KEY and how to choose it, and what the chosen one has. None: another error."""
    from omegaconf.errors import OmegaConfBaseException

    while error is not None:
        key = getattr(error, "full_key", None) if isinstance(error, OmegaConfBaseException) else None
        if isinstance(key, str) and key.startswith("backend.") and key.count(".") >= 1:
            chosen = next((s for s in BACKENDS.values() if getattr(error, "object_type", None) is s.config_class),
                          None)
            field = key.split(".")[1]
            if chosen is not None and field not in chosen.fields():
                return "config: " + _misplaced(field, key, chosen)
        error = error.__cause__ or error.__context__
    return None


def _misplaced(field: str, key: str, chosen: BackendSpec) -> str:
    owners = [s for s in BACKENDS.values() if field in s.fields()]
    has = f"backend {chosen.name} has: {', '.join(chosen.fields())}"
    if owners:
        where = " and ".join(f"the {s.name} backend ({s.presets_hint()})" for s in owners)
        why = DIMENSIONS[field].elsewhere if field in DIMENSIONS else ""
        return f"backend.{field} is a field of {where}{f' ({why})' if why else ''}; {has}"
    if field in PLANNED:
        return (f"backend.{field}: no backend has {PLANNED[field]} yet (the layout's dimensions: "
                f"{' × '.join(d.name for d in mesh_order())}; {', '.join(carved_dimensions())}); {has}")
    return f"{key} is not a field of any backend ({', '.join(BACKENDS)}); {has}"
