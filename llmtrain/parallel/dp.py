"""Data parallelism: dp_replicate (HSDP replica groups: gradients all-reduced between them) × dp_shard (ranks that
shard parameters, gradients and optimizer state: FSDP; DDP and DeepSpeed: every rank). `backend.dp_shard=-1` takes
whatever the world leaves. The data-parallel size, ranks that read different examples, is their product
(ParallelDims.dp_size); the backends' collectives carry their traffic (metrics/cost.py)."""

from __future__ import annotations

from llmtrain.parallel.dimension import Dimension, register


def _replica_views(world, dims) -> dict:
    """"dp": the replicas and shards flattened (the sampler's coordinates, the loss reduction)."""
    return {"dp": world[dims.dp_dim_names]._flatten("dp")}


DP_REPLICATE = register(Dimension(name="dp_replicate", position=10,
                                  meshes=_replica_views))
DP_SHARD = register(Dimension(name="dp_shard", position=20,
                              default=-1))
