"""The fused LM head split over the vocabulary across the tp ranks (Megatron's vocab-parallel cross-entropy, torch's
`loss_parallel`), used by backend=fsdp2 with backend.tp > 1 while model.fused_loss is on.

`shard_head_over_vocab` makes the head's weight (V, h) (and bias) a Shard(0) DTensor on the tp mesh: rank r holds
the rows [r·⌈V/tp⌉, ...) as torch.chunk cuts them (FSDP2, checkpoints and the export still see the whole tensor).
The fused head (models/fused_head.py) then computes, per chunk of n tokens, the local logits (n, V/tp) only:
- log-sum-exp in fp32 from the max all-reduced (MAX) over tp, then Σ exp(z − max), the target's logit (from the rank
  that owns it, 0 elsewhere) and, for the entropy, Σ exp(z − max)·z, all three in one SUM all-reduce;
- argmax hits: each rank's first maximal column, the smallest global index among the ranks holding the global max
  (MIN all-reduce): torch's argmax over the whole row;
- backward: the local weight gradient (V/tp, h) is the local rows' own; the hidden states' gradient is a sum over
  the vocabulary, so each rank's part is all-reduced (SUM) once per forward, after its last chunk.
No (tokens, V) tensor exists; per rank one chunk's (n, V/tp) buffers.

Outside a query (generation, a plain forward) the head returns the whole logits: the local columns gathered.
A head tied to the input embedding stays replicated (sharding the one tensor would shard the embedding lookup too,
which is not done): `shard_head_over_vocab` says so in the log and returns False. The pipeline engine (backend.pp)
keeps its last stage's head replicated as well.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmtrain.losses.lm import IGNORE_INDEX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the head: [start, start + rows) of the whole vocabulary `vocab`, over `mesh` (the tp mesh).
    `group` None: a process group of one (the unit tests' hand check), no collective."""
    start: int
    rows: int
    vocab: int
    mesh: object = None
    group: object = None

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor


def shard_rows(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """(start, rows) of tp rank `rank`, as torch.chunk (and DTensor's Shard(0)) cut V rows: ⌈V/tp⌉ each, the last
    ranks fewer (or none)."""
    size = math.ceil(vocab / tp)
    start = min(rank * size, vocab)
    return start, min(size, vocab - start)


def owned_columns(targets: torch.Tensor, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """targets (n,) global ids (IGNORE_INDEX: none) -> (local column (n,) clamped into range, owned (n,) bool)."""
    cols = targets - shard.start
    owned = (targets != IGNORE_INDEX) & (cols >= 0) & (cols < shard.rows)
    return cols.clamp(0, max(shard.rows - 1, 0)), owned


def sharded_chunk_values(z: torch.Tensor, targets: torch.Tensor, shard: VocabShard, entropy: bool, accuracy: bool):
    """z (n, V/tp) fp32 local logits, targets (n,) -> (log p (n,), local log-softmax (n, V/tp), entropy (n,) or None,
    correct (n,) or None), each the value over the whole vocabulary (the module docstring's collectives)."""
    valid = targets != IGNORE_INDEX
    cols, owned = owned_columns(targets, shard)
    local_max, local_arg = z.max(-1)  # (n,), (n,): the first maximal column
    row_max = shard.all_reduce(local_max.clone(), dist.ReduceOp.MAX)  # (n,)
    exp = (z - row_max.unsqueeze(1)).exp_()  # (n, V/tp)
    picked = torch.where(owned, z.gather(1, cols.unsqueeze(1)).squeeze(1), torch.zeros_like(local_max))
    sums = [exp.sum(-1), picked, *([(exp * z).sum(-1)] if entropy else [])]
    sums = shard.all_reduce(torch.stack(sums))  # (2 or 3, n)
    del exp
    lse = row_max + sums[0].log()  # (n,) fp32 log Σ_V exp z
    logp = torch.where(valid, sums[1] - lse, torch.zeros_like(lse))
    log_probs = z - lse.unsqueeze(1)  # (n, V/tp)
    ent = lse - sums[2] / sums[0] if entropy else None  # H = lse − Σ p·z
    correct = None
    if accuracy:
        first = torch.where(local_max == row_max, local_arg + shard.start, torch.full_like(local_arg, shard.vocab))
        correct = (shard.all_reduce(first, dist.ReduceOp.MIN) == targets) & valid
    return logp, log_probs, ent, correct


def local_head(head: torch.nn.Module):
    """(weight (V/tp, h) or (V, h), bias or None, VocabShard or None): the head's local rows, differentiable (a
    DTensor's to_local() gives its gradient back as the same Shard(0) DTensor)."""
    shard = getattr(head, "vocab_shard", None)
    if shard is None:
        return head.weight, head.bias, None
    weight = head.weight.to_local()
    if weight.shape[0] != shard.rows:
        raise RuntimeError(f"vocab-sharded LM head: local rows {weight.shape[0]}, expected {shard.rows}")
    return weight, None if head.bias is None else head.bias.to_local(), shard


def gathered_logits(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """(..., V/tp) local logits -> (..., V): the whole row on every rank (a plain forward); differentiable."""
    from torch.distributed.tensor import DTensor, Shard

    shape = (*local.shape[:-1], shard.vocab)
    stride = torch.empty(shape, device="meta").stride()
    whole = DTensor.from_local(local, shard.mesh, (Shard(local.dim() - 1),), run_check=False, shape=shape,
                               stride=stride)
    return whole.full_tensor()


def is_tied(model: torch.nn.Module) -> bool:
    embedding = model.get_input_embeddings()
    return embedding is not None and model.get_output_embeddings().weight is embedding.weight


def shard_head_over_vocab(model: torch.nn.Module, tp_mesh) -> bool:
    """Split the fused LM head's rows over `tp_mesh` in place (module docstring; the caller checks that the head is
    the fused one: with model.fused_loss=off it stays a replicated Linear computing full logits). False (nothing done)
    when the head is tied to the embedding."""
    from torch.distributed.tensor import Shard, distribute_tensor

    head = model.get_output_embeddings()
    tp = tp_mesh.size()
    if is_tied(model):
        log.info("tp=%d: the LM head is tied to the input embedding: kept replicated over tp (each tp rank computes "
                 "every logit of a chunk)", tp)
        return False
    if shard_rows(head.out_features, tp, tp - 1)[1] == 0:  # torch.chunk would leave the last rank no row
        log.info("tp=%d: the LM head's %d rows leave the last tp rank none: kept replicated over tp", tp,
                 head.out_features)
        return False
    for name in ("weight", "bias"):
        param = getattr(head, name)
        if param is not None:
            sharded = distribute_tensor(param, tp_mesh, (Shard(0),), src_data_rank=None)
            head.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
    start, rows = shard_rows(head.out_features, tp, tp_mesh.get_local_rank())
    head.vocab_shard = VocabShard(start, rows, head.out_features, tp_mesh, tp_mesh.get_group())
    log.info("tp=%d: LM head split over the vocabulary, %d of %d rows per rank (vocab-parallel loss)", tp, rows,
             head.out_features)
    return True
