"""`backend.cp_implementation=torch`: torch's context parallelism (torch.distributed.tensor.experimental) as the
attention of the cp ranks, in place of llmtrain's ring (models/ring_attention.py).

What torch runs: the attention's q, k, v become DTensors sharded on the sequence over the cp mesh, and
F.scaled_dot_product_attention on them reaches torch's CP handlers, which run its own ring around CUDA's flash,
memory-efficient or cuDNN kernel (whichever SDPA picks: fp32 gets memory-efficient), merging the blocks through
their log-sum-exps. Its rotate method is torch's default (`allgather`: every rank gathers the cp − 1 other k/v blocks
once per layer; `torch.distributed.tensor.experimental._attention.set_rotate_method("alltoall")` passes them round).
What it does not run: the CPU (its flash kernel has no sharding strategy), masks or packed samples (causal only),
sliding windows, attention dropout; parallel/cp.torch_cp_blocker refuses those before any model loads.

The rows' cut is torch's head-tail load balancer (`_HeadTailLoadBalancer`: rank i holds chunks i and 2·cp−1−i of
2·cp), which is data/sequence_shard.py's zig-zag (tests/unit/test_ring_attention.py checks the two index for index):
the batch is cut on the host by that one code path, so the target count stays a host int and the loss stays
normalised by the target tokens of the whole global batch. torch's `context_parallel(buffers=...)` context manager
is not used: it resizes the batch's tensors in place and patches F.scaled_dot_product_attention for every model of
the process; this module wraps the one attention function it registers (torchtitan's module-wrapper way).

GQA: k and v are repeated to the query heads before the ring (torch's handlers take equal heads), so each rank moves
H/KV times the k/v bytes llmtrain's ring does.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from llmtrain.models.attention import SEGMENT_LENGTHS, _no_dense_mask

_names = itertools.count()
log = logging.getLogger(__name__)


def torch_cp_positions(width: int, rank: int, cp: int) -> torch.Tensor:
    """(width / cp,) long: the row positions torch's head-tail load balancer gives cp rank `rank`, cut as DTensor's
    Shard(seq) cuts the rearranged row (torch.chunk)."""
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    order = _HeadTailLoadBalancer(width, cp, "cpu")._generate_indices()[0]  # (width,) head-tail order
    return order.chunk(cp)[rank]


def register_torch_context_parallel(cp: int, mesh) -> str:
    """Register torch's context parallelism over `mesh` (the 1-D cp DeviceMesh) with transformers under a name of
    its own, for `attn_implementation`; "sdpa" in the name, as register_ring_attention's."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _ContextParallel,
        _cp_options,
        _enable_context_parallel_dispatcher,
    )

    _enable_context_parallel_dispatcher()  # DTensor's SDPA ops -> torch's ring handlers
    _cp_options.enable_load_balance = True  # the rows are cut head-tail: its causal blocks assume it
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    name = f"torchcp{next(_names)}_cp{cp}_sdpa"

    def attention(module, query, key, value, attention_mask, **kwargs):
        # query (B, H, L, D), key/value (B, KV, L, D): this rank's head-tail chunks of every row
        if kwargs.get("sliding_window") is not None or kwargs.get(SEGMENT_LENGTHS) is not None:
            raise ValueError("torch's context parallelism attends causally over whole rows (no sliding window, no "
                             "packed samples): set backend.cp_implementation=ring")
        groups = query.shape[1] // key.shape[1]
        key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))  # (B, H, L, D)
        (q, k, v), _ = style.sdpa_input_fn(None, (query, key, value), {}, mesh)  # DTensors, Shard(2) over cp
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             scale=kwargs.get("scaling", getattr(module, "scaling", None)))
        out = style.sdpa_output_fn(None, None, out, mesh)  # (B, H, L, D) this rank's
        return out.transpose(1, 2).contiguous(), None  # (B, L, H, D)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, _no_dense_mask)
    return name


def register_cp_attention(implementation: str, cp: int, mesh) -> str:
    """The cp ranks' attention, registered: "ring" (llmtrain's, over the mesh's group) or "torch" (this module)."""
    if dist.get_rank() == 0:
        log.info("context parallelism: %s (backend.cp_implementation), over %d ranks", implementation, cp)
    if implementation == "torch":
        return register_torch_context_parallel(cp, mesh)
    from llmtrain.models.ring_attention import register_ring_attention

    return register_ring_attention(cp, mesh.get_group())
