"""A parallel dimension is one module (parallel/dp.py, tp.py, sp.py, cp.py, pp.py, ep.py), registered here as stages
are.

A `Dimension` says everything the rest of the program asks about one degree: its field (`backend.<name>`), where it
sits in the device mesh, whether its ranks read the same examples (then it divides the data-parallel size) or it is
carved out of other dimensions (ep: from dp_shard × tp, the data-parallel size unchanged), its checks on the degrees
alone, on the model's config and on the planner's model facts (every problem collected, each naming the field and
the fix), the meshes it adds, and how it applies to the model in the fixed order:

    tp → sp / cp → ep → (activation checkpointing) → compile → fsdp → pp

(torchtitan's: tensor parallelism first, so everything after sees DTensor shards; FSDP last on each block, so it
shards what the others left; the pipeline splits the result into stages). Pure Python: nothing here imports
torch.distributed, so the config checks and the planner run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Dimension:
    name: str  # the degree's field, backend.<name>, and its mesh dimension's name
    position: int | None  # place in the world mesh, outermost first; None: carved out of others (`carved_from`)
    default: int = 1  # the degree of a backend without the field
    same_data: bool = False  # its ranks read the same examples: it divides the data-parallel size (tp, sp, cp, pp)
    shares_rows: bool = False  # its ranks hold other tokens of the same rows (sp, cp): their sums add up (layout.py)
    carved_from: tuple[str, ...] = ()  # ep: a regrouping of these dimensions' ranks, not a factor of the world
    # (backend cfg, degrees {name: degree}) -> problems of the degrees and the dimension's own fields
    problems: Callable[[Any, dict], list[str]] | None = None
    # (backend cfg, ParallelDims, transformers config) -> problems of this model at these degrees (asked when > 1)
    arch_problems: Callable[[Any, Any, Any], list[str]] | None = None
    # (backend cfg, ParallelDims, models.facts.ModelFacts) -> the same on the planner's facts (no config at hand)
    facts_problems: Callable[[Any, Any, Any], list[str]] | None = None
    # (world DeviceMesh, ParallelDims) -> {name: DeviceMesh} the views it adds (flattened or regrouped dims)
    meshes: Callable[[Any, Any], dict] | None = None
    # why the backends whose config lacks the field do not run it (their messages say so)
    elsewhere: str = ""
    # (model, ParallelDims) -> None: applies the dimension to the model (FSDP2 engine, in APPLY_ORDER)
    apply: Callable[[Any, Any], None] | None = None
    # (model, ParallelDims, **fully_shard kwargs) -> None: FSDP units of its own, before the blocks' (ep's experts)
    shard: Callable[..., None] | None = None
    # (metrics.cost.Layout, models.facts.ModelFacts, precision, *, tokens_per_micro, accum, trainable, checkpointing)
    # -> [metrics.cost.Collective] this dimension adds to one optimizer step (the planner, and through it the live
    # cost's planned bytes); None: counted elsewhere (dp: the backend's collectives; tp: metrics/cost.communication)
    collectives: Callable[..., list] | None = None
    # (plan.setting.Setting, plan.core.Row) -> the planner's line on this dimension for a row whose layout has it > 1
    plan_line: Callable[[Any, Any], str] | None = None


DIMENSIONS: dict[str, Dimension] = {}

# The order dimensions apply to the model (module docstring): names of DIMENSIONS, then the backend's own steps.
APPLY_ORDER = ("tp", "sp", "cp", "ep")

# Dimensions no backend has yet: named, so `backend.<name>=2` gets a message that says so.
PLANNED: dict[str, str] = {}


def register(dimension: Dimension) -> Dimension:
    if dimension.name in DIMENSIONS:
        raise ValueError(f"parallel dimension {dimension.name!r} registered twice")
    DIMENSIONS[dimension.name] = dimension
    return dimension


def mesh_order() -> list[Dimension]:
    """The world mesh's dimensions, outermost first (carved ones are views of these)."""
    return sorted((d for d in DIMENSIONS.values() if d.position is not None), key=lambda d: d.position)


def carved_dimensions() -> list[str]:
    """`ep from dp_shard × tp`: the carved dimensions, as messages name them."""
    return [f"{d.name} from {' × '.join(d.carved_from)}" for d in DIMENSIONS.values() if d.position is None]


def applied_in_order() -> list[Dimension]:
    return [DIMENSIONS[name] for name in APPLY_ORDER if name in DIMENSIONS and DIMENSIONS[name].apply is not None]


def dimension_collectives(layout: Any, facts: Any, precision: str, **shape: Any) -> list:
    """Every dimension's collectives of one step on this layout (those whose degree on the layout is > 1)."""
    return [c for d in DIMENSIONS.values() if d.collectives is not None and getattr(layout, d.name, 1) > 1
            for c in d.collectives(layout, facts, precision, **shape)]


def dimension_lines(setting: Any, rows: list) -> list[str]:
    """The planner's line of every dimension, for each row whose layout has it > 1 (the planner's report)."""
    return [d.plan_line(setting, row) for d in DIMENSIONS.values() if d.plan_line is not None
            for row in rows if getattr(row.layout, d.name, 1) > 1]


def degrees_of(backend: Any) -> dict[str, int]:
    """{dimension: degree} a backend config asks for: the one reader of `backend.<dimension>` fields (a backend without
    a field, or null in it, has the dimension's default: dp_shard -1, the rest of the world; every other 1). A degree
    stays as written (0 or negative too) for the checks to refuse."""
    return with_defaults({name: getattr(backend, name, None) for name in DIMENSIONS})


def with_defaults(degrees: dict[str, int | None]) -> dict[str, int]:
    """Every registered dimension's degree: as given, else (absent or None) its default."""
    return {name: dim.default if degrees.get(name) is None else int(degrees[name]) for name, dim in DIMENSIONS.items()}


def degree_of(backend: Any, name: str) -> int:
    """One degree of a backend config (`degrees_of`)."""
    return degrees_of(backend)[name]


def shared_rows(degrees: dict[str, int]) -> dict[str, int]:
    """{dimension: degree} of the row-sharing dimensions (sp, cp) above 1 among these degrees."""
    return {name: degrees[name] for name, dim in DIMENSIONS.items() if dim.shares_rows and degrees[name] > 1}


def row_degrees(backend: Any) -> dict[str, int]:
    """`shared_rows` of a backend config."""
    return shared_rows(degrees_of(backend))
