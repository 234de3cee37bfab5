"""Communication counted from the real collectives, while `CommCounter.counting()` is open (the first steps).

Every backend's traffic reaches a few torch.distributed functions: DeepSpeed through `deepspeed.comm` (whose
TorchBackend calls `torch.distributed.all_reduce` / `reduce` and the `all_gather_into_tensor` /
`reduce_scatter_tensor` it captured at start, which call `all_gather_single` / `reduce_scatter_single` in
distributed_c10d), FSDP2 through `dist.all_gather_single` / `dist.reduce_scatter_single`. DDP's reducer calls the
C++ all-reduce itself: `route_ddp_buckets` registers torch's stock `allreduce_hook` (divide by the world, sum: the
built-in's arithmetic), which reaches `dist.all_reduce` from Python per bucket. While counting, those functions are
wrapped in both namespaces (`torch.distributed` and `distributed_c10d`), each call counted once; outside, the
originals are back.

Pipeline stages (backend.pp > 1) send their hidden states forward and their gradients back point to point: every
torch.distributed.pipelining schedule takes the sends of a micro-batch from its stage's `get_fwd_send_ops` /
`get_bwd_send_ops`, which are wrapped too while counting (kind `p2p`: the bytes this rank sends, payload = wire).

Ring attention (backend.cp > 1) passes key/value blocks and their gradients point to point: every exchange goes
through `models.ring_attention.exchange`, wrapped too while counting (kind `p2p`: the bytes of its sends).

Per call: the payload (the whole tensor handed to it: an all-gather's output, a reduce-scatter's input, the
all-reduced tensor) and the ring wire volume this rank sends: 2(g-1)/g of the payload for an all-reduce, (g-1)/g for
the others (docs/formulas.md, "Collectives") — named apart, like metrics/cost.py's `Collective.payload` and `.wire`.
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast", "all_to_all", "p2p")
PIPELINE_SENDS = ("get_fwd_send_ops", "get_bwd_send_ops")  # torch.distributed.pipelining's stage methods
RING = "llmtrain.models.ring_attention"  # its `exchange(ops)`: ring attention's point-to-point sends


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else None


def _bytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors or ())


# function -> (kind, (position, name) of the tensor(s) whose bytes are the payload, (position, name) of `group`)
COLLECTIVES = {
    "all_reduce": ("all_reduce", (0, "tensor"), (2, "group")),
    "all_gather_single": ("all_gather", (0, "output_tensor"), (2, "group")),
    "reduce_scatter_single": ("reduce_scatter", (1, "input"), (3, "group")),
    "reduce": ("reduce", (0, "tensor"), (3, "group")),
    "broadcast": ("broadcast", (0, "tensor"), (2, "group")),
    "all_gather": ("all_gather", (0, "tensor_list"), (2, "group")),
    "reduce_scatter": ("reduce_scatter", (1, "input_list"), (3, "group")),
    "all_to_all_single": ("all_to_all", (1, "input"), (4, "group")),  # Ulysses (models/ulysses.py)
}


def ring_factor(kind: str, group: int) -> float:
    """Bytes this rank sends per payload byte in a ring."""
    if group <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (group - 1) / group


@contextlib.contextmanager
def wrapped_collectives(names, wrap):
    """For the block, each of torch.distributed's functions `names` (those this torch has) is `wrap(name, original)`
    in both namespaces (`torch.distributed` and `distributed_c10d`: callers use either), the original being c10d's;
    restored after, whatever happens. Wrappers nest: one opened inside another wraps its wrappers."""
    names = [name for name in names if hasattr(c10d, name)]
    saved = {(module, name): getattr(module, name) for module in (dist, c10d) for name in names
             if hasattr(module, name)}
    wrapped = {name: wrap(name, getattr(c10d, name)) for name in names}
    try:
        for module, name in saved:
            setattr(module, name, wrapped[name])
        yield
    finally:
        for (module, name), function in saved.items():
            setattr(module, name, function)


class CommCounter:
    """Payload, wire bytes and calls per collective kind on this rank."""

    def __init__(self):
        self.payload: dict[str, float] = defaultdict(float)
        self.wire: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def _wrap(self, name: str, original):
        kind, (t_pos, t_name), (g_pos, g_name) = COLLECTIVES[name]

        def counted(*args, **kwargs):
            payload = _bytes(_arg(args, kwargs, t_pos, t_name))
            group = dist.get_world_size(_arg(args, kwargs, g_pos, g_name))
            self.payload[kind] += payload
            self.wire[kind] += ring_factor(kind, group) * payload
            self.calls[kind] += 1
            return original(*args, **kwargs)

        counted.__wrapped__ = original
        return counted

    def _wrap_sends(self, original):
        """A pipeline stage's send-op getter, counting the bytes of the tensors it hands to isend."""
        def counted(stage, *args, **kwargs):
            ops = original(stage, *args, **kwargs)
            self._count_sends(sum(_bytes(op.tensor) for op in ops), len(ops))
            return ops

        counted.__wrapped__ = original
        return counted

    def _count_sends(self, sent: int, calls: int) -> None:
        self.payload["p2p"] += sent
        self.wire["p2p"] += sent
        self.calls["p2p"] += calls

    @contextlib.contextmanager
    def _counting_ring(self):
        """Wrap ring attention's exchange for the block (when it is loaded: else no run sends through it)."""
        module = sys.modules.get(RING)
        if module is None:
            yield
            return
        original = module.exchange

        def counted(ops):
            sends = [op for op in ops if op.op.__name__ == "isend"]
            self._count_sends(sum(_bytes(op.tensor) for op in sends), len(sends))
            return original(ops)

        try:
            module.exchange = counted
            yield
        finally:
            module.exchange = original

    @contextlib.contextmanager
    def _counting_sends(self):
        """Wrap the pipeline stages' send-op getters for the block (when torch's pipelining is loaded: else no run
        sends through it)."""
        module = sys.modules.get("torch.distributed.pipelining.stage")
        if module is None:
            yield
            return
        base = module._PipelineStageBase
        saved = {name: getattr(base, name) for name in PIPELINE_SENDS}
        try:
            for name, original in saved.items():
                setattr(base, name, self._wrap_sends(original))
            yield
        finally:
            for name, original in saved.items():
                setattr(base, name, original)

    @contextlib.contextmanager
    def counting(self):
        """Wrap the collectives for the block; the originals are restored after it, whatever happens."""
        with wrapped_collectives(COLLECTIVES, self._wrap), self._counting_sends(), self._counting_ring():
            yield self

    def local(self) -> dict[str, float]:
        """`<kind>_payload`, `<kind>_wire`, `<kind>_calls` for every kind (zeros too: every rank has the same keys)."""
        out = {}
        for kind in KINDS:
            out.update({f"{kind}_payload": self.payload[kind], f"{kind}_wire": self.wire[kind],
                        f"{kind}_calls": self.calls[kind]})
        return out


def route_ddp_buckets(module: torch.nn.Module) -> bool:
    """DDP: its buckets through torch's stock Python all-reduce hook, so `CommCounter` sees them (True if done).
    Registered once, for the run (DDP cannot unregister a hook); it only adds a Python call per bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return False
    module.register_comm_hook(None, allreduce_hook)
    return True


def planned(collectives) -> dict[str, float]:
    """The plan's collectives (metrics/cost.py `Collective`s of one step) as `<kind>_payload` and `<kind>_wire`."""
    out: dict[str, float] = defaultdict(float)
    for c in collectives:
        if c.group <= 1:  # a group of one rank calls nothing (DDP on one process, dp 1)
            continue
        out[f"{c.kind}_payload"] += c.payload * c.times
        out[f"{c.kind}_wire"] += c.wire
    return dict(out)
