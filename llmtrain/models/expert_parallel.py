"""Expert parallelism (backend.ep): each MoE layer's experts split over `ep` ranks, their tokens exchanged all-to-all.

The layout is transformers 5.25's (`transformers.distributed`): ep is carved from dp_shard × tp, so the data-parallel
size does not change, and the expert view of the same ranks is efsdp × ep with efsdp = dp_shard · tp / ep (ep a
multiple of tp; ep innermost, so an ep group holds whole tp groups). Dense parameters keep their dp/tp layout; rank
r of an ep group holds experts [r·E/ep, (r+1)·E/ep) of every MoE layer (a Shard(0) DTensor on the ep mesh), FSDP-
sharded once more over the efsdp ranks that hold the same experts (`shard_experts`).

What transformers gives and what is ours:
- theirs: the model's `base_model_ep_plan` (which modules are the routed experts), the param style `grouped_gemm`
  (MoEParamShard: Shard(0) on ep, `num_experts` set to the local count) and the module style `ep_dispatch_experts`
  (EpDispatchExpertsParallel: local parameter views around the call, an EPImplementation bringing the tokens);
  the experts' own forward (`@use_experts_implementation`, grouped_mm on the CPU) runs the local experts.
- ours: the EPImplementation (`CountedAllToAll`, registered in transformers' EPImplementationInterface). transformers'
  AllToAllEP trains correctly here too (measured on 2 and 4 gloo ranks under this module's FSDP layout: the same
  parity as ours), but it moves the tokens with functional collectives (`_c10d_functional.all_to_all_single`) and
  exchanges the counts with an `all_to_all_single` imported by name: the live meter (metrics/comm.py wraps
  `torch.distributed.all_to_all_single`) counts none of it, forward or backward (measured: 0 bytes). Ours sends the
  same rows through `dist.all_to_all_single` in an autograd Function, so `all_to_all_bytes` is checked against a live
  count. Same algorithm otherwise: sort the (token, slot) pairs by expert, exchange the counts, the rows, run the local
  experts top-1 with unit weights, send the outputs back, weight them by the router on the sender.
- ours: the checks (`ep_problems`), the expert FSDP unit and its gradient scale (`shard_experts`), the figures.

Composition with backend.tp (models/tp.py splits experts E/tp with ExpertsOverTP when ep is off): under ep the experts
leave the tp plan (`apply_tp_plan(..., experts=False)`) and are split E/ep here, beside tp. The ranks of a tp group
hold the same tokens: each dispatches its 1/tp slice of them (a local chunk; backward all-gathers the row gradients),
and the outputs are all-gathered back over tp, so no token is computed twice. ep = tp: the ep group is the tp group
(same expert placement as ExpertsOverTP, tokens exchanged instead of all-reduced); ep > tp: an ep group spans ep/tp
dp ranks, whose different tokens meet at the experts.
"""

from __future__ import annotations

import math
from fnmatch import fnmatch
from typing import Any

import torch
import torch.distributed as dist

EP_STYLE = "ep_dispatch_experts"  # transformers' module style for routed experts in base_model_ep_plan
IMPLEMENTATION = "llmtrain_all_to_all"  # our EPImplementation's name in transformers' registry
FIX = "set backend.ep=1"


# ---- pure checks and figures (config only: the planner and validation call these) ------------------------------

def expert_paths(arch: Any) -> list[str]:
    """The backbone paths of the routed experts modules (`layers.*.mlp.experts`) from the config's ep plan."""
    return [path for path, style in (getattr(arch, "base_model_ep_plan", None) or {}).items() if style == EP_STYLE]


def ep_problems(arch: Any, ep: int, tp: int = 1) -> list[str]:
    """Why this model cannot split its experts over backend.ep=ep ranks (empty: it can), before any weight loads. The
    degrees' own rules (ep a multiple of tp, dividing dp_shard × tp) are parallel/ep.py's; LoRA's, lora_checks'."""
    from llmtrain.models.moe import expert_count

    if ep <= 1:
        return []
    experts, name = expert_count(arch), getattr(arch, "model_type", type(arch).__name__)
    if not experts or not expert_paths(arch):
        return [f"backend.ep={ep}: {name} is a dense model (no routed experts in its base_model_ep_plan), so there "
                f"are no experts to split; {FIX}"]
    if experts % ep:
        return [f"backend.ep={ep} must divide the model's {experts} experts ({name}: each ep rank holds "
                f"experts/ep whole experts); pick backend.ep among {_multiples_dividing(tp, experts)}"]
    return []


def _multiples_dividing(tp: int, experts: int) -> list[int]:
    return [d for d in range(tp, experts + 1, tp) if experts % d == 0 and d > 1] or [1]


def efsdp_size(dp_shard: int, tp: int, ep: int) -> int:
    """The ranks holding the same experts, FSDP-sharding them (transformers' efsdp = fsdp · tp / ep)."""
    return dp_shard * tp // ep


def moe_layers(arch: Any) -> int:
    """Decoder layers with routed experts (Qwen-MoE's decoder_sparse_step and mlp_only_layers; Mixtral: all)."""
    step, dense = getattr(arch, "decoder_sparse_step", 1) or 1, set(getattr(arch, "mlp_only_layers", None) or ())
    return sum(1 for i in range(arch.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def expert_params_per_rank(arch: Any, ep: int, efsdp: int = 1) -> int:
    """Routed-expert parameters one rank stores: E/ep experts per MoE layer, gate_up (2I, h) + down (h, I) each,
    FSDP-sharded along the expert dim over efsdp (ceil: FSDP2 pads dim 0 to a multiple of efsdp)."""
    from llmtrain.models.moe import expert_count

    inter = getattr(arch, "moe_intermediate_size", None) or arch.intermediate_size
    rows = math.ceil(expert_count(arch) // ep / efsdp)
    return moe_layers(arch) * rows * 3 * inter * arch.hidden_size


def all_to_all_bytes(arch: Any, tokens: int, *, ep: int, tp: int = 1, element_bytes: int = 4,
                     recompute: bool = False) -> int:
    """`exchange_bytes` of a transformers config."""
    from llmtrain.models.moe import expert_count

    return exchange_bytes(experts=expert_count(arch), top_k=arch.num_experts_per_tok, moe_layers=moe_layers(arch),
                          hidden=arch.hidden_size, tokens=tokens, ep=ep, tp=tp, element_bytes=element_bytes,
                          recompute=recompute)


def exchange_bytes(*, experts: int, top_k: int, moe_layers: int, hidden: int, tokens: int, ep: int, tp: int = 1,
                   element_bytes: int = 4, recompute: bool = False, backward: bool = True) -> int:
    """Bytes one rank hands to `dist.all_to_all_single` (the live meter's payload) for `tokens` tokens of its batch
    (a tp group shares them: each peer sends 1/tp): per MoE layer, forward the expert counts (E int64) and the (token,
    slot) rows out and back, backward their gradients back and out. Rows out = tokens/tp · k exactly; rows back = the
    rows this rank's experts received, tokens/tp · k under balanced routing (exact in the sum over the ep group).
    recompute: activation checkpointing runs each layer's forward twice; backward False: a frozen role's forward only.
    (The planner calls this with its facts.)"""
    if ep == 1:
        return 0
    rows = tokens // tp * top_k
    forward = 8 * experts + 2 * rows * hidden * element_bytes
    gradients = 2 * rows * hidden * element_bytes if backward else 0
    return moe_layers * ((2 if recompute else 1) * forward + gradients)


# ---- the all-to-all dispatch ----------------------------------------------------------------------------------

class _Exchange(torch.autograd.Function):
    """Rows to other ranks: `send_sizes[j]` rows of x go to rank j, `recv_sizes[j]` rows come from it. Backward is the
    reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv_sizes, send_sizes = ctx.sizes
        out = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_sizes, recv_sizes, group=ctx.group)
        return out, None, None, None


def _transformers_ep():
    from transformers.distributed import expert_parallel

    return expert_parallel


def _implementation_class():
    """CountedAllToAll, defined once against transformers' base class and registered under IMPLEMENTATION."""
    ep_module = _transformers_ep()
    registry = ep_module.EPImplementationInterface
    if IMPLEMENTATION not in registry._global_mapping:
        registry.register(IMPLEMENTATION, type("CountedAllToAll", (ep_module.EPImplementation,), {
            "__init__": _init, "__call__": _dispatch_and_combine,
            "__doc__": "transformers' AllToAllEP algorithm through dist.all_to_all_single (counted by metrics/comm.py)"
        }))
    return registry._global_mapping[IMPLEMENTATION]


def _init(impl, experts: torch.nn.Module, ep_mesh, tp_mesh) -> None:
    """As EPImplementation's, with tp_mesh None (no tp: every rank its own tokens)."""
    impl.experts_forward = experts.forward  # the experts' own forward, on local expert ids
    impl.num_local_experts, impl.ep_mesh, impl.tp_mesh = experts.num_experts, ep_mesh, tp_mesh


def _tp_slice(impl, tensors):
    """This tp peer's row slice of the tokens its tp group shares (Replicate -> Shard(0): a local chunk; backward
    all-gathers the row gradients)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if impl.tp_mesh is None or impl.tp_mesh.size() == 1:
        return tensors
    return [DTensor.from_local(t, impl.tp_mesh, [Replicate()], run_check=False)
            .redistribute(impl.tp_mesh, [Shard(0)]).to_local() for t in tensors]


def _tp_gather(impl, output: torch.Tensor, tokens: int) -> torch.Tensor:
    """(n, h) this peer's rows -> (N, h) every row of the tp group (uneven slices too)."""
    from torch.distributed.tensor import DTensor, Shard

    if impl.tp_mesh is None or impl.tp_mesh.size() == 1:
        return output
    hidden = output.shape[-1]
    return DTensor.from_local(output.contiguous(), impl.tp_mesh, [Shard(0)], shape=(tokens, hidden),
                              stride=(hidden, 1)).full_tensor()


def _dispatch_and_combine(impl, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states (N, h), top_k_index / top_k_weights (N, k): global expert ids -> (N, h) weighted expert outputs."""
    tokens = hidden_states.shape[0]
    hidden_states, top_k_index, top_k_weights = _tp_slice(impl, (hidden_states, top_k_index, top_k_weights))
    group, ep, local = impl.ep_mesh.get_group(), impl.ep_mesh.size(), impl.num_local_experts
    k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)  # (n·k,)
    order = torch.argsort(expert_ids, stable=True)  # by expert, so by owner rank (contiguous ranges)
    send_counts = torch.bincount(expert_ids, minlength=local * ep).view(ep, local)  # (ep, E/ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_sizes, recv_sizes = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = _Exchange.apply(hidden_states[order // k], recv_sizes, send_sizes, group)  # (R, h)
    local_ids = torch.arange(local, device=received.device).repeat(ep)  # (ep·E/ep,) the order rows arrive in
    local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1))[:, None]  # (R, 1)
    out = _run_local_experts(impl, received, local_ids)  # (R, h)
    returned = _Exchange.apply(out, send_sizes, recv_sizes, group)  # (n·k, h) in expert order
    per_slot = torch.empty_like(returned)
    per_slot[order] = returned
    combined = (per_slot.view(*top_k_weights.shape, -1) * top_k_weights.unsqueeze(-1)).sum(1)  # (n, h)
    return _tp_gather(impl, combined, tokens)


def _run_local_experts(impl, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """rows (R, h) for this rank's experts -> (R, h), top-1 with unit weights (the router's weights are applied on
    the sender). No rows: the experts still run on an empty slice, so the parameters and the exchange stay in the
    backward graph on every rank (FSDP's reduce-scatter and the reverse all-to-all are collectives)."""
    if rows.shape[0]:
        return impl.experts_forward(rows, local_ids, rows.new_ones(local_ids.shape))
    dummy = rows.sum(0, keepdim=True)  # (1, h) zeros, connected to `rows`
    return impl.experts_forward(dummy, local_ids.new_zeros((1, 1)), rows.new_ones((1, 1)))[:0]


# ---- applying it to a model -----------------------------------------------------------------------------------

def experts_modules(model: torch.nn.Module, arch: Any) -> list[tuple[str, torch.nn.Module]]:
    """(backbone path, module) of every routed experts module the config's ep plan names."""
    from llmtrain.models.backbone import backbone

    paths = expert_paths(arch)
    return [(name, module) for name, module in backbone(model).named_modules()
            if any(fnmatch(name, path) for path in paths)]


def apply_expert_parallel(model: torch.nn.Module, ep_mesh, tp_mesh=None, arch: Any = None) -> int:
    """Split every MoE layer's experts over `ep_mesh` in place (after tp, which must leave the experts out:
    `apply_tp_plan(..., experts=False)`; before fully_shard). `tp_mesh`: the ranks holding the same tokens (None
    without tp); an ep group holds whole tp groups. arch: the transformers config (default: model.config).
    -> the number of experts modules split."""
    from torch.distributed.tensor import Shard

    ep_module, arch = _transformers_ep(), arch if arch is not None else model.config
    _implementation_class()
    modules = experts_modules(model, arch)
    for _, module in modules:
        shard = ep_module.MoEParamShard(Shard(0), shards_expert_dim=True)  # also sets num_experts to E/ep
        for name in [n for n, p in module.named_parameters(recurse=False) if p.shape[0] == module.num_experts]:
            shard.shard_param(module, name, ep_mesh)
        ep_module.EpDispatchExpertsParallel().install_forward(module, ep_mesh, tp_mesh=tp_mesh,
                                                              ep_implementation=IMPLEMENTATION)
    return len(modules)


def shard_experts(model: torch.nn.Module, efsdp_mesh, dp_size: int, arch: Any = None, **fsdp_kwargs) -> None:
    """fully_shard each experts module on `efsdp_mesh` (after apply_expert_parallel, before the blocks' fully_shard,
    which then leaves them out). fsdp_kwargs: the blocks' (reshard_after_forward, mp_policy, offload_policy).

    Gradient scale: llmtrain multiplies each rank's loss by dp_size, since FSDP averages over dp (backends/fsdp2.py).
    An expert's gradient on one rank already sums the tokens of the ep/tp batches of its ep group (the all-to-all's
    backward), and the efsdp reduction adds those of the other efsdp ranks: all dp_size batches, each scaled by
    dp_size. So it is divided by dp_size, not by efsdp (FSDP's default, wrong by ep/tp). gloo has no PREMUL_SUM:
    with efsdp > 1 the reduction is a plain sum, divided after (with efsdp = 1 FSDP2 divides locally, no collective)."""
    from torch.distributed.fsdp import fully_shard

    for _, module in experts_modules(model, arch if arch is not None else model.config):
        fully_shard(module, mesh=efsdp_mesh, **fsdp_kwargs)
        module.set_gradient_divide_factor(float(dp_size))
        if efsdp_mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)
