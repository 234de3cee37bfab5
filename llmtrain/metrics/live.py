"""Live cost on the first few steps of every run, next to the planner's figure for the same config.

Per rank: the bytes autograd saves for backward during one forward (`torch.autograd.graph.saved_tensors_hooks`:
each storage once, weights excluded — the activations), the process's peak RSS, on a GPU CUDA's max allocated;
on rank 0 model FLOPs utilisation on a GPU with a known peak (tokens/s is logged every step anyway). The
planner's per-rank figures come with them: model states as metrics/cost.py says this backend holds them, and
activations + logits at the shape the peak forward really had (metrics/cost.py's formula for this model).

Flat keys for metrics.jsonl (`memory_r<rank>_activations` next to `memory_r<rank>_plan_activations` at that
rank's shape `memory_r<rank>_activation_rows` × `_seq`, `memory_r<rank>_rss_peak`, `plan_memory_state`,
`plan_memory_activations` (rank 0's), `comm_r<rank>_...` next to `plan_comm_...`, `mfu`, on step 1 the planner's
`plan_step_time_s` where it predicted one); W&B shows them under memory/ and perf/. After `steps` steps every hook
is removed: nothing is measured or logged later.

Under a pipeline (backend.pp > 1) every figure is the rank's own: the meter watches the stage modules this rank runs
(every virtual stage), which the schedule calls (the rank's whole model is never called), and `activations` is the
peak of the bytes saved for backward that are alive at the same time over the micro-batches in flight
(`InFlightMeter`: GPipe holds all M forwards, 1F1B about P − rank); the plan's figure is the same quantity
(plan.pp.StageActivations.rank: the chunks in flight at the rank's peak, the head on the last stage only), and the
plan's model states are the rank's stages' (plan.pp.rank_state_bytes). Extra keys there: `memory_r<rank>_in_flight`
(micro-batch chunks alive at the measured peak) next to `_plan_in_flight`, and `memory_r<rank>_plan_state`;
`plan_memory_state` is rank 0's. `activation_rows` × `_seq` is the micro-batch's shape (b, W).
"""

from __future__ import annotations

import contextlib
import resource
import threading
from dataclasses import dataclass, replace

import torch

from llmtrain.metrics.comm import KINDS, CommCounter, route_ddp_buckets
from llmtrain.metrics.memory import gather_per_rank


def _weight(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (Linear saves `weight.t()`): model state, not an activation."""
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def _live_storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage a saved tensor views; None when it is already freed (FSDP2 reshards the
    unsharded parameters it views): both meters count each storage once by its pointer."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return None


class SavedTensorMeter:
    """Bytes autograd saves for backward, per forward of the watched modules (each storage once, weights not
    counted); `peak` is the largest forward's, `shape` its input's (rows, sequence)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules, self.handles = modules, []
        self.current, self.peak, self.shape, self.tokens = 0, 0, (0, 0), 0
        self._seen: set[int] = set()
        self._input_shape = (0, 0)

    def _pre_forward(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        if ids is None or not torch.is_grad_enabled():
            return
        self._new_forward()
        self._input_shape = tuple(ids.shape[-2:]) if ids.dim() >= 2 else (1, ids.shape[-1])
        self.tokens += ids.numel()

    def _new_forward(self) -> None:
        if self.current > self.peak:
            self.peak, self.shape = self.current, self._input_shape
        self.current, self._seen = 0, set()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "meta" or type(tensor) not in (torch.Tensor, torch.nn.Parameter) or _weight(tensor):
            return tensor  # DTensors and other subclasses: their local tensors are saved and counted themselves
        storage = _live_storage(tensor)
        if storage is None:
            return tensor
        pointer, nbytes = storage
        if pointer not in self._seen:
            self._seen.add(pointer)
            self.current += nbytes
        return tensor

    @contextlib.contextmanager
    def watch(self):
        self.handles = [m.register_forward_pre_hook(self._pre_forward, with_kwargs=True) for m in self.modules]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield self
        finally:
            for handle in self.handles:
                handle.remove()
            self._new_forward()


class _Held:
    """A saved tensor as autograd holds it (InFlightMeter's pack hook): its bytes count until autograd lets it go."""
    __slots__ = ("meter", "pointer", "forward", "tensor")

    def __init__(self, meter, pointer: int, forward: int, tensor: torch.Tensor):
        self.meter, self.pointer, self.forward, self.tensor = meter, pointer, forward, tensor

    def __del__(self):
        self.meter._release(self.pointer, self.forward)


class InFlightMeter:
    """Under a pipeline: the bytes autograd saves for backward that are alive at the same time on this rank, over
    every micro-batch in flight (each storage once, weights not counted); a saved tensor counts from its forward's
    pack until autograd frees it (after its node's backward). `peak` is the largest such sum in a step, `in_flight`
    the forwards (micro-batch chunks) holding saved tensors at that moment, `shape` the micro-batch's (b, W)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules, self.handles = modules, []
        self.current, self.peak, self.in_flight, self.shape, self.tokens = 0, 0, 0, (0, 0), 0
        self._storages: dict[int, list[int]] = {}  # storage pointer -> [saved tensors holding it, bytes]
        self._forwards: dict[int, int] = {}  # forward number -> its saved tensors still held
        self._forward, self._lock = 0, threading.Lock()  # backward may free on autograd's device threads

    def _pre_forward(self, module, args) -> None:
        """A stage's forward of one micro-batch: x (b, W) token ids on the first stage, else (b, W, h) hidden states."""
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return
        self._forward += 1
        self.shape = tuple(args[0].shape[:2])
        if module is self.modules[0]:  # each micro-batch once, at the rank's first stage
            self.tokens += self.shape[0] * self.shape[1]

    def _pack(self, tensor: torch.Tensor):
        if tensor.device.type == "meta" or _weight(tensor):
            return tensor
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor (TP in the stages): its shard is held here
        if type(local) not in (torch.Tensor, torch.nn.Parameter):
            return tensor
        storage = _live_storage(local)
        if storage is None:
            return tensor
        pointer, nbytes = storage
        with self._lock:
            entry = self._storages.setdefault(pointer, [0, nbytes])
            if entry[0] == 0:
                self.current += entry[1]
            entry[0] += 1
            self._forwards[self._forward] = self._forwards.get(self._forward, 0) + 1
            if self.current > self.peak:
                self.peak, self.in_flight = self.current, len(self._forwards)
        return _Held(self, pointer, self._forward, tensor)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, pointer: int, forward: int) -> None:
        with self._lock:
            entry = self._storages[pointer]
            entry[0] -= 1
            if entry[0] == 0:
                self.current -= entry[1]
                del self._storages[pointer]
            self._forwards[forward] -= 1
            if self._forwards[forward] == 0:
                del self._forwards[forward]

    @contextlib.contextmanager
    def watch(self):
        self.handles = [m.register_forward_pre_hook(self._pre_forward) for m in self.modules]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for handle in self.handles:
                handle.remove()


@dataclass(frozen=True)
class PipelineRankFigures:
    """The planner's figures for one pp rank (plan.pp.rank_state_bytes, plan.pp.StageActivations.rank)."""
    state_bytes: float  # its stages' model states
    activations: object  # (rows, seq) -> bytes of its micro-batch chunks in flight at its peak
    in_flight: int  # micro-batch chunks in flight at its peak (plan.pp.in_flight)


@dataclass(frozen=True)
class PlanFigures:
    """The planner's per-rank numbers for this run (llmtrain/plan.py's row) and how to size activations."""
    # model states on the device, every role: weights, master, grads, optimizer (what the ledger counts)
    state_bytes: float
    gathered_bytes: float  # + the working copies gathered while computing (ZeRO-3 / FSDP2 modules, autocast's copies)
    activations: object  # (rows, seq) -> activation + logits bytes of one forward of one role
    flops_per_token: float  # this rank's share of a trained token's model FLOPs: (6·M + 12·L·h·s) / (tp·pp)
    hardware_flops_per_token: float  # + one more forward of the blocks under activation checkpointing
    peak_flops: float | None  # the device's dense 16-bit peak (plan.gpu / plan.peak_tflops); None: no MFU
    comm: dict  # `<kind>_payload` / `<kind>_wire` of one step (metrics/cost.py `communication`)
    pipeline: tuple[PipelineRankFigures, ...] = ()  # backend.pp > 1: per pp rank
    step_s: float | None = None  # the planner's step time (a GPU with a known peak; None: no prediction)

    def for_pp_rank(self, rank: int) -> PlanFigures:
        """This pp rank's figures: its model states and its activations in flight in place of the whole model's."""
        mine = self.pipeline[rank]
        return replace(self, state_bytes=mine.state_bytes, activations=mine.activations, pipeline=(mine,))


class LiveCost:
    """The trainer's hook: `with live.step(n):` around a step's work, then `live.record(n, step_time)`."""

    def __init__(self, *, modules: list[torch.nn.Module], plan: PlanFigures, ctx, steps: int = 2,
                 pipelined: bool = False):
        """pipelined: `modules` are this rank's pipeline stages and `plan` its pp rank's (PlanFigures.for_pp_rank)."""
        self.modules, self.plan, self.ctx, self.steps, self.pipelined = modules, plan, ctx, steps, pipelined
        self.meter: SavedTensorMeter | InFlightMeter | None = None
        self.counter: CommCounter | None = None
        for module in modules:
            route_ddp_buckets(module)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)

    def active(self, step: int) -> bool:
        return step <= self.steps

    @contextlib.contextmanager
    def step(self, step: int):
        if not self.active(step):
            yield
            return
        self.meter = (InFlightMeter if self.pipelined else SavedTensorMeter)(self.modules)
        self.counter = CommCounter()
        with self.meter.watch(), self.counter.counting():
            yield

    def record(self, step: int, step_time: float) -> dict:
        """This step's measured and planned figures (a collective over ranks on the steps it measures)."""
        if not self.active(step) or self.meter is None:
            return {}
        meter, counter, self.meter, self.counter = self.meter, self.counter, None, None
        local = {"activations": meter.peak, "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "plan_activations": self.plan.activations(*meter.shape),  # at this rank's own largest forward
                 "activation_rows": meter.shape[0], "activation_seq": meter.shape[1]}
        if self.ctx.device.type == "cuda":
            local["cuda_peak"] = torch.cuda.max_memory_allocated(self.ctx.device)
        if self.pipelined:
            local.update({"in_flight": meter.in_flight, "plan_in_flight": self.plan.pipeline[0].in_flight,
                          "plan_state": self.plan.state_bytes})
        out = gather_per_rank(local, self.ctx.world_size, self.ctx.rank, self.ctx.device)
        state = out["memory_r0_plan_state"] if self.pipelined else self.plan.state_bytes
        out.update({"plan_memory_state": state, "plan_memory_gathered": self.plan.gathered_bytes,
                    "plan_memory_activations": out["memory_r0_plan_activations"]})
        out.update(self._comm(counter))
        if self.plan.step_s is not None and step == 1:  # once: what llmtrain.doctor compares the step time with
            out["plan_step_time_s"] = self.plan.step_s
        if self.plan.peak_flops:  # this rank's trained tokens (with padding) over its own time
            out["mfu"] = meter.tokens * self.plan.flops_per_token / (step_time * self.plan.peak_flops)
            out["hfu"] = meter.tokens * self.plan.hardware_flops_per_token / (step_time * self.plan.peak_flops)
        return out

    def _comm(self, counter: CommCounter) -> dict:
        """Counted per rank (`comm_r<rank>_<kind>_{payload,wire,calls}`) and planned (`plan_comm_<kind>_...`), the
        kinds that either has; totals `comm_r<rank>_payload`/`_wire` and `plan_comm_payload`/`_wire`."""
        local = counter.local()
        local.update({"payload": sum(local[f"{k}_payload"] for k in KINDS),
                      "wire": sum(local[f"{k}_wire"] for k in KINDS)})
        gathered = gather_per_rank(local, self.ctx.world_size, self.ctx.rank, self.ctx.device, prefix="comm")
        plan = self.plan.comm
        used = {k for k in KINDS if f"{k}_payload" in plan or any(gathered[f"comm_r{r}_{k}_calls"]
                                                                  for r in range(self.ctx.world_size))}
        unused = set(KINDS) - used
        out = {key: value for key, value in gathered.items() if key.split("_", 2)[2].rsplit("_", 1)[0] not in unused}
        out.update({f"plan_comm_{key}": value for key, value in plan.items()})
        out.update({"plan_comm_payload": sum(v for k, v in plan.items() if k.endswith("_payload")),
                    "plan_comm_wire": sum(v for k, v in plan.items() if k.endswith("_wire"))})
        return out


class NoLiveCost:
    """Measures nothing (a trainer built without a LiveCost)."""

    @contextlib.contextmanager
    def step(self, step: int):
        yield

    def record(self, step: int, step_time: float) -> dict:
        return {}


def live_cost(ctx, plan: PlanFigures, engines: dict, roles: list[str], steps: int = 2) -> LiveCost:
    """The run's LiveCost: the trainable roles' modules watched against the plan's figures (computed once per run);
    under a pipeline, the stage modules this rank runs against its pp rank's figures."""
    pipelined = [engines[role] for role in roles if getattr(engines[role], "pipelined", False)]
    if pipelined and plan.pipeline:  # pipeline_checks: one trainable role runs through the stages
        engine = pipelined[0]
        return LiveCost(modules=list(engine.parts), plan=plan.for_pp_rank(engine.pp_rank), ctx=ctx, steps=steps,
                        pipelined=True)
    return LiveCost(modules=[engines[role].module for role in roles], plan=plan, ctx=ctx, steps=steps)
