"""FSDP2's model onto its mesh (backends/fsdp2.py is the engine): `parallelize()` in a fixed order, and the
weights of a model built on the meta device filled from rank 0.

`parallelize()` applies, in this order (torchtitan's; parallel/dimension.py APPLY_ORDER):
  1. the parallel dimensions set, each its own `apply` (parallel/<dim>.py):
     tp            — transformers' TP plan on the "tp" mesh: q/k/v/gate/up colwise, o/down rowwise; the fused
                     LM head's rows split over the vocabulary (models/vocab_parallel.py).
                     TP comes first because it replaces Linear weights by DTensors; FSDP then shards
                     those DTensors once more along dim 0 on the dp mesh (2-D (dp, tp) DTensors). The
                     other way round FSDP would gather full weights that TP then slices again.
     ep            — experts split over the "ep" mesh, tokens exchanged by all-to-all (models/expert_parallel.py);
                     apply_fsdp then shards each rank's experts over "efsdp" (the ranks holding the same ones).
     (sp)          — Ulysses sequence parallelism has no step here either: the model was built with the run's
                     Ulysses attention (models/ulysses.py, an all-to-all around each attention), and apply_fsdp
                     shards over dp_shard × sp flattened (the "fsdp" mesh): sp peers hold the same weights and
                     their gradients are summed like dp peers' (each saw other tokens of the same rows).
  2. (activation checkpointing: no step here) — it must wrap a block's forward *inside* FSDP's hooks,
                     so the recompute in backward does not all-gather again; transformers' checkpointing
                     (model.activation_checkpointing, set by the loader before this) wraps `forward`,
                     which is exactly that.
  3. apply_compile — per block, before FSDP: graph breaks stay at block boundaries and FSDP's hooks
                     run eagerly around each compiled block (`Module.compile` keeps parameter names).
  4. apply_fsdp    — blocks first, then the root: each call groups the parameters not yet claimed,
                     so one all-gather per block, and the root's group holds embeddings, final norm and
                     LM head. The root is not resharded after forward: backward needs it first.

Model init (torchtitan's / torchtune's way): only rank 0 builds the whole fp32 model (random init or
from_pretrained, exactly as DDP does, so the weights are bit-identical); the other ranks build the same
modules on the meta device (`FSDP2Backend.model_init_context`), with no storage and nothing read.
Rank 0 then sets its weights aside and empties its model too, so that every rank parallelizes the same
empty model (TP's distribute_tensor scatters real weights from rank 0, a step meta ranks would skip);
all allocate their shards (`to_empty`) and fill them from rank 0's full state dict, one tensor
broadcast at a time (`load_from_rank0`). A 7B thus costs 28 GB of host memory on rank 0 only, not on
each of the 8 ranks of a node (rank 0 holds its shards and the full copy together until the load ends).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

from llmtrain.models.backbone import backbone
from llmtrain.models.lora import unwrap_peft
from llmtrain.parallel import DIMENSIONS, ParallelDims, applied_in_order

# ---- parallelize: the fixed order ---------------------------------------------------------------

def apply_dimensions(model: torch.nn.Module, dims: ParallelDims) -> None:
    """Each parallel dimension set (> 1) with an `apply`, in the fixed order."""
    for dim in applied_in_order():
        if getattr(dims, dim.name) > 1:
            dim.apply(model, dims)


def apply_compile(blocks: list[torch.nn.Module]) -> None:
    for block in blocks:
        block.compile(fullgraph=False)


def apply_fsdp(model: torch.nn.Module, blocks: list[torch.nn.Module], dims: ParallelDims, *,
               reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy) -> None:
    """A dimension's own units first (ep: experts on "efsdp"), then each block and the root on "fsdp"."""
    kwargs = {"reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy, "offload_policy": offload_policy}
    for dim in DIMENSIONS.values():
        if dim.shard is not None and getattr(dims, dim.name) > 1:
            dim.shard(model, dims, **kwargs)
    dp_mesh = dims.mesh("fsdp")
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload_policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy,
                offload_policy=offload_policy)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers (`base_model.layers` for Llama/Qwen2/Mistral, `.h` for GPT-2)."""
    base = backbone(unwrap_peft(model))  # a PeftModel's own base_model is peft's LoraModel
    for name in ("layers", "h", "blocks"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            return list(getattr(base, name))
    raise ValueError(f"{type(model).__name__}: no decoder layer list (base_model.layers / .h) to shard per block")


def parallelize(model: torch.nn.Module, dims: ParallelDims, *, reshard_after_forward: bool,
                mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy, compile: bool) -> None:
    """The run's meshes come from `dims` by name: "tp" for the TP plan, "fsdp" (dp_shard, or HSDP's (dp_replicate,
    dp_shard)) for fully_shard."""
    blocks = decoder_blocks(model)
    apply_dimensions(model, dims)  # then activation checkpointing: already in place (the loader's, see the docstring)
    if compile:
        apply_compile(blocks)
    apply_fsdp(model, blocks, dims, reshard_after_forward=reshard_after_forward,
               mp_policy=mp_policy, offload_policy=offload_policy)


# ---- meta-device init: the weights come from rank 0 -------------------------------------------------

def ranks_on_meta(model: torch.nn.Module) -> list[int]:
    """The ranks whose model was built on the meta device (a collective: every rank calls it)."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())))
    return [rank for rank, on_meta in enumerate(flags) if on_meta]


def set_aside_and_empty(model: torch.nn.Module) -> tuple[dict, dict]:
    """Rank 0: (its full state dict, all its buffers), by reference; the model itself goes to meta."""
    weights = model.state_dict(), dict(model.named_buffers())  # non-persistent buffers are not in the first
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # in place: tied weights stay one Parameter
    try:
        model.to_empty(device="meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    return weights


def load_from_rank0(model: torch.nn.Module, rank0_weights: tuple[dict, dict] | None, device: torch.device, *,
                    cpu_offload: bool) -> None:
    """After parallelize: allocate this rank's shards (DTensors on the dp or (dp, tp) mesh) and fill them from
    rank 0's full state dict; `rank0_weights` comes from set_aside_and_empty on rank 0, None elsewhere."""
    state, buffers = rank0_weights or ({}, {})
    # FSDP re-points its sharded parameters (FSDPModule._apply; ties hold). Offloaded shards live on the host
    # (pinned by FSDP there), buffers on the device: where fully_shard puts them when given real tensors.
    model.to_empty(device="cpu" if cpu_offload else device)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if cpu_offload:
        for module in model.modules():
            module._buffers.update({name: b.to(device) for name, b in module._buffers.items() if b is not None})
    # A state dict holds no non-persistent buffers (the rotary inv_freq of Llama/Qwen2/Mistral); buffers are
    # small, so all of them are copied from rank 0.
    for name, buffer in model.named_buffers():
        if buffers:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    # Building on meta drew no random numbers: take rank 0's generator, as if this rank had built the same
    # model from the same seed (what DDP's ranks do), so dropout and later draws match DDP's.
    rng = [torch.get_rng_state()]
    dist.broadcast_object_list(rng, src=0)
    torch.set_rng_state(rng[0])
