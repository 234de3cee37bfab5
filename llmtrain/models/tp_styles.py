"""The two ParallelStyles transformers' TP plans name that torch does not ship (tp.py says where each is used).

HeadShardedNorm: a norm over the head dim of q or k (Qwen3's, Gemma-3's q_norm / k_norm) that sits between a
colwise and a rowwise projection, so each tp rank normalises its own heads with the one weight (head_dim,).

ExpertsOverTP: an experts module holding every expert's weights stacked along dim 0 (Mixtral's, Qwen3-MoE's
gate_up_proj (E, 2I, h) and down_proj (E, h, I)), split over the tp ranks as whole experts.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class HeadShardedNorm(ParallelStyle):
    """Weight: a Replicate DTensor. Input: this rank's heads, given to DTensor as sharded along dim 0 (any dim but
    the normalised last one says the same: the rows differ between ranks, the weight does not), so the weight's
    gradient, a sum over rows, comes out Partial; FSDP2 reduces it to the weight's Replicate over tp. Forward:
    no collective."""

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return distribute_module(module, device_mesh, input_fn=_rows_differ, output_fn=_local)


def _rows_differ(module, inputs, device_mesh):
    return (DTensor.from_local(inputs[0], device_mesh, (Shard(0),), run_check=False), *inputs[1:])


def _local(module, output, device_mesh):
    return output.to_local()


class ExpertsOverTP(ParallelStyle):
    """Rank r of tp holds experts [r·E/tp, (r+1)·E/tp) (every stacked parameter: a Shard(0) DTensor, so FSDP2,
    checkpoints and the export see the whole (E, ...) tensors). All tp ranks hold the same tokens and routing: each
    runs its own experts on the tokens routed to them (transformers' expert-parallel contract: `num_experts` is the
    local count and a local id equal to it marks a token for another rank's expert) and the outputs are summed."""

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        if not routed_experts(module):
            raise ValueError(f"{type(module).__name__} is not called as transformers' routed experts "
                             "(hidden_states, top_k_index, top_k_weights): its experts cannot be split over tp")
        experts, tp = module.num_experts, device_mesh.size()
        for name, param in list(module.named_parameters(recurse=False)):
            assert param.shape[0] == experts, f"{type(module).__name__}.{name}: {tuple(param.shape)} not per expert"
            sharded = distribute_tensor(param, device_mesh, (Shard(0),), src_data_rank=None)
            module.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        local = experts // tp
        module.num_experts, module._is_expert_parallel = local, True
        module.forward = partial(_local_experts_forward, module, module.forward, device_mesh.get_group(),
                                 first=device_mesh.get_local_rank() * local)
        return module


def routed_experts(module: torch.nn.Module) -> bool:
    """Whether this experts module has transformers' routed-experts call, which ExpertsOverTP wraps (Llama-4's
    takes tokens pre-sorted per expert instead)."""
    return len(inspect.signature(module.forward).parameters) == 3


def _local_experts_forward(module, forward, group, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, *, first: int) -> torch.Tensor:
    """hidden_states (N, h), top_k_index / top_k_weights (N, k): the same on every tp rank -> (N, h) summed."""
    local = module.num_experts
    local_index = top_k_index - first
    local_index = local_index.masked_fill((local_index < 0) | (local_index >= local), local)
    hidden_states, top_k_weights = (_SumGradients.apply(t, group) for t in (hidden_states, top_k_weights))
    stacked = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    try:
        module._parameters.update({name: p.to_local() for name, p in stacked.items()})  # differentiable views
        partial_out = forward(hidden_states, local_index, top_k_weights)
    finally:
        module._parameters.update(stacked)
    return _SumOutputs.apply(partial_out, group)


class _SumOutputs(torch.autograd.Function):
    """Forward: all-reduce (sum) the partial outputs. Backward: every rank already holds the whole gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SumGradients(torch.autograd.Function):
    """Forward: identity (a replicated input). Backward: each rank's gradient covers its experts' tokens: sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None

