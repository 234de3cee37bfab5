"""ParallelDims: how a run's world splits over the registered dimensions (parallel/dimension.py), and its meshes.

world = pp × dp_replicate × dp_shard × cp × sp × tp (the dimensions with a mesh position, outermost first: tp innermost,
so tensor-parallel peers are adjacent ranks, on a node NVLink). Carved dimensions (ep) regroup some of these ranks
and leave the world's product alone. The data-parallel size (ranks that read different examples) is derived here
only: dp_replicate × dp_shard. Every error prints every degree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from typing import Any, Callable

from llmtrain.data.sequence_shard import RowShare
from llmtrain.parallel.dimension import DIMENSIONS, degrees_of, mesh_order, with_defaults

NAMED_ALWAYS = ("dp_replicate", "dp_shard", "tp")  # in every message; the others when set


def shown_degrees(degrees: dict[str, int], item: str) -> str:
    """Every degree a message names, `item` formatted with {name} and {degree}: the mesh's outermost first
    (dp_replicate, dp_shard and tp always, the others when not 1), then the carved ones that are set, in parentheses."""
    mesh = [d.name for d in mesh_order() if d.name in NAMED_ALWAYS or degrees[d.name] != 1]
    carved = [d.name for d in DIMENSIONS.values() if d.position is None and degrees[d.name] != 1]
    text = " × ".join(item.format(name=n, degree=degrees[n]) for n in mesh)
    return text + (f" ({', '.join(item.format(name=n, degree=degrees[n]) for n in carved)})" if carved else "")


def describe_degrees(degrees: dict[str, int]) -> str:
    """`backend.dp_replicate=1 × backend.dp_shard=4 × backend.tp=2` (pp, sp, ... only when set, carved ones after)."""
    return shown_degrees(degrees, "backend.{name}={degree}")


def degree_problems(degrees: dict[str, int], world_size: int) -> list[str]:
    """Pure arithmetic: what is wrong with these degrees for this world size (empty: fine)."""
    text = describe_degrees(degrees)
    bad = [f"backend.{n}={v} must be >= 1" for n, v in degrees.items() if v < 1 and not (n == "dp_shard" and v == -1)]
    if degrees["dp_shard"] == 0:
        bad[-1] += ", or -1 to infer it from the world size"
    if bad:
        return [f"{b} ({text}, world size {world_size})" for b in bad]
    factors = {d.name: degrees[d.name] for d in mesh_order()}
    if factors["dp_shard"] == -1:
        fixed = {n: v for n, v in factors.items() if n != "dp_shard" and (n in NAMED_ALWAYS or v != 1)}
        if world_size % prod(fixed.values()):
            named = " × ".join(f"backend.{n}={v}" for n, v in fixed.items())
            change = " / ".join(f"backend.{n}" for n in fixed if n != "dp_replicate" and (n == "tp" or fixed[n] > 1))
            return [f"backend.dp_shard=-1 (infer) needs world size {world_size} divisible by {named} = "
                    f"{prod(fixed.values())}; change {change} / backend.dp_replicate or the number of processes"]
        return []
    if prod(factors.values()) != world_size:
        return [f"{text} = {prod(factors.values())}, not the world size {world_size} (nnodes × nproc_per_node); set "
                "backend.dp_shard=-1 to infer it or change the degrees"]
    return []


def _inferred(degrees: dict[str, int], world_size: int) -> dict[str, int]:
    """The degrees with dp_shard=-1 replaced by what the world leaves (degrees that fit it: degree_problems)."""
    if degrees["dp_shard"] != -1:
        return degrees
    others = prod(v for n, v in degrees.items() if n != "dp_shard" and DIMENSIONS[n].position is not None)
    return {**degrees, "dp_shard": world_size // others}


@dataclass(frozen=True)
class ParallelDims:
    """One per run, owned by the backend object that wraps every role: its device meshes are built once, on first use
    (`mesh(name)`), on `device_type`, and handed out by name to every engine. `device_type=None`: arithmetic only (the
    checks, the planner). A degree reads as an attribute: `dims.tp`, `dims.sp`, `dims.ep`."""

    resolved: tuple[tuple[str, int], ...]  # (dimension, degree) of every registered dimension, dp_shard inferred
    world_size: int
    device_type: str | None = None
    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def problems(cls, world_size: int, backend: Any = None, **degrees: int) -> list[str]:
        """Every problem of these degrees (keywords; unnamed ones take their defaults) and, given the backend config,
        of each dimension's own fields."""
        full = with_defaults(degrees)
        found = degree_problems(full, world_size)
        if not found:  # each dimension's own checks see dp_shard inferred
            found = [p for dim in DIMENSIONS.values() if dim.problems is not None
                     for p in dim.problems(backend, _inferred(full, world_size))]
        return found

    @classmethod
    def build(cls, world_size: int, device_type: str | None = None, **degrees: int) -> ParallelDims:
        from llmtrain.config import ConfigError

        problems = cls.problems(world_size, **degrees)
        if problems:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
        return cls(tuple(_inferred(with_defaults(degrees), world_size).items()), world_size, device_type)

    @classmethod
    def of(cls, backend: Any, world_size: int, device_type: str | None = None) -> ParallelDims:
        """The run's layout from its backend config: ConfigError (every degree named) when it does not fit."""
        return cls.build(world_size, device_type, **degrees_of(backend))

    @classmethod
    def data_parallel_size(cls, degrees: dict[str, int], world_size: int) -> int:
        """Ranks that read different examples: the one place it is derived. For degrees that do not fit the world
        (reported by the checks) the world over the dimensions whose ranks share their data."""
        if cls.problems(world_size, **degrees):
            shared = prod(max(1, degrees.get(d.name, 1)) for d in DIMENSIONS.values() if d.same_data)
            return max(1, world_size // shared)
        return cls.build(world_size, **degrees).dp_size

    def on(self, device_type: str) -> ParallelDims:
        """The same layout with its meshes on `device_type` (none built yet)."""
        return replace(self, device_type=device_type)

    def __getattr__(self, name: str) -> int:
        if name.startswith("_") or name not in DIMENSIONS:
            raise AttributeError(name)
        return dict(self.resolved)[name]

    @property
    def degrees(self) -> dict[str, int]:
        return dict(self.resolved)

    @property
    def dp_size(self) -> int:
        """Ranks that read different examples (the one place it is derived)."""
        return self.dp_replicate * self.dp_shard

    def model_problems(self, backend: Any, load_arch: Callable[[], Any]) -> list[str]:
        """Every set dimension's problems with this model, each naming the field and the fix; `load_arch()` (its
        transformers config, no weights) is called only when a dimension set here (> 1) checks the model."""
        checks = [d.arch_problems for d in self._set() if d.arch_problems is not None]
        arch = load_arch() if checks else None
        return [p for check in checks for p in check(backend, self, arch)]

    def facts_problems(self, backend: Any, facts: Any) -> list[str]:
        """model_problems on the planner's model facts."""
        return [p for d in self._set() if d.facts_problems is not None for p in d.facts_problems(backend, self, facts)]

    def _set(self) -> list:
        """The registered dimensions whose degree here is > 1."""
        return [d for d in DIMENSIONS.values() if getattr(self, d.name) > 1]

    @property
    def dp_dim_names(self) -> tuple[str, ...]:
        """The mesh dims of data parallelism: ("dp_shard",), or ("dp_replicate", "dp_shard") for HSDP."""
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    @property
    def row_dim_names(self) -> tuple[str, ...]:
        """The set dimensions whose ranks hold other tokens of the same rows (cp, sp; outermost first)."""
        return tuple(d.name for d in mesh_order() if d.shares_rows and getattr(self, d.name) > 1)

    @property
    def row_size(self) -> int:
        """Ranks that share each row: cp × sp."""
        return prod(getattr(self, n) for n in self.row_dim_names)

    @property
    def fsdp_dim_names(self) -> tuple[str, ...]:
        """What fully_shard shards over: dp_dim_names, with cp and sp folded into dp_shard (their peers hold the same
        weights and sum their gradients, as dp peers do)."""
        if not self.row_dim_names:
            return self.dp_dim_names
        shard = "_".join(("dp_shard", *self.row_dim_names))
        return ("dp_replicate", shard) if self.dp_replicate > 1 else (shard,)

    def data_parallel(self, rank: int) -> tuple[int, int, object]:
        """(dp_rank, dp_size, dp_group) of this rank: which examples it reads, among how many ranks, and the group
        its loss and token sums are reduced over. Every rank its own data (no tp, no replicas): the world (group
        None), no mesh needed; otherwise the "dp" mesh. With cp or sp the sums are reduced over their peers too (each
        holds other tokens of the same rows): the "loss" group (`loss_group`)."""
        if self.dp_size == self.world_size and self.dp_replicate == 1:
            return rank, self.world_size, None
        mesh = self.mesh("dp")
        return mesh.get_local_rank(), mesh.size(), self.loss_group() if self.row_size > 1 else mesh.get_group()

    def loss_group(self):
        """Ranks whose loss and token sums add up to the global batch's: dp × cp × sp (None: the world, when no tp)."""
        if self.tp == 1:
            return None
        return self.mesh("loss").get_group()

    def row_share(self) -> RowShare:
        """The ranks that share each row (cp × sp): this rank's shard of each row, among how many, the group its
        per-sequence sums are summed over (pair stages), and cp."""
        if self.row_size == 1:
            return RowShare()
        mesh = self.mesh("rows")
        return RowShare(mesh.get_local_rank(), mesh.size(), mesh.get_group(), self.cp)

    def mesh(self, name: str):
        """A device mesh by name, from the world mesh built once: "world"; a dimension's own ("dp_shard" always, the
        others when > 1); "dp" (ranks that read different data); "fsdp" (what fully_shard shards over); and the views
        each dimension adds (`Dimension.meshes`: "dp_shard_tp", "ep", "efsdp", ...; with cp or sp: "rows",
        "dp_shard_sp" / "dp_shard_cp" / "dp_shard_cp_sp", "loss")."""
        if name not in self._meshes:
            self._meshes[name] = self._make_mesh(name)
        return self._meshes[name]

    def _make_mesh(self, name: str):
        if name == "world":
            return self._build_world_mesh()
        world = self.mesh("world")
        if name in self._meshes:  # a view registered while the world mesh was built
            return self._meshes[name]
        names = {"dp": "dp" if self.dp_replicate > 1 else "dp_shard", "fsdp": self.fsdp_dim_names}.get(name, name)
        try:
            return world[names]
        except (KeyError, RuntimeError, ValueError) as error:
            views = ", ".join(n for n in self._meshes if n != "world")
            raise ValueError(f"no {name!r} mesh in this layout ({self}); meshes: world, dp, fsdp, "
                             f"{', '.join(world.mesh_dim_names)}{', ' + views if views else ''}") from error

    def _build_world_mesh(self):
        """Named DeviceMesh, tp innermost; dp_shard is always a dim (size 1 is fine: fully_shard then only keeps its
        DTensor bookkeeping), the others only when > 1; then each dimension's views. A collective: every rank builds
        it, once."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.device_type is None:
            raise ValueError(f"ParallelDims({self}) has no device type: build it with .on(device_type) for meshes")
        names = tuple(d.name for d in mesh_order() if d.name == "dp_shard" or getattr(self, d.name) > 1)
        mesh = init_device_mesh(self.device_type, tuple(getattr(self, n) for n in names), mesh_dim_names=names)
        self._meshes["world"] = mesh
        for dim in DIMENSIONS.values():
            if dim.meshes is not None and getattr(self, dim.name) > 1:
                self._meshes.update(dim.meshes(mesh, self))
        if self.row_dim_names:
            self._meshes.update(self._row_views(mesh))
        return mesh

    def _row_views(self, world) -> dict:
        """"rows" (the ranks that share each row: cp × sp), "dp_shard_<cp>_<sp>" (what fully_shard shards over) and
        "loss" (dp × cp × sp: the ranks whose loss and token sums add up to the global batch's)."""
        rows = self.row_dim_names
        views = {"rows": world[rows] if len(rows) == 1 else world[rows]._flatten("rows")}
        shard = "_".join(("dp_shard", *rows))
        views[shard] = world[("dp_shard", *rows)]._flatten(shard)
        views["loss"] = world[(*self.dp_dim_names, *rows)]._flatten("loss")
        return views

    def __str__(self) -> str:
        layout = shown_degrees(self.degrees, "{name} {degree}")
        return f"world {self.world_size} = {layout} (data parallel {self.dp_size})"


def divisors_of_all(values: list[int]) -> list[int]:
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]
