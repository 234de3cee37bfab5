"""Prototypes of proposed llmtrain changes, applied by monkeypatching the benchmark's own process only
(llmtrain's files are untouched). Each one is what the benchmark README recommends, in miniature:

- single_process_no_ddp: backends/ddp.py DDPEngine.__init__ wraps the model in DistributedDataParallel
  even in a world of one, so every backward copies all gradients into DDP's buckets and all-reduces them
  over a 1-rank gloo group. Proposed: `self.module = self.model` when ctx.world_size == 1 (no_sync then
  is a nullcontext).
- plain_console: metrics/sinks.py ConsoleSink runs a rich live Progress, which redraws from a background
  thread 10×/s for the whole run. Proposed: no live display when stderr is not a TTY (or
  auto_refresh=False and refresh on log), a line every log_every_n_steps.
- segment_attention: with sdpa (CPU, or GPU without flash-attn) every batch reaches attention with a
  dense mask: unpacked rows a (B, T) padding mask that transformers expands, packed rows collate's
  (B, 1, T, T) block-diagonal float mask. A dense mask keeps sdpa off its causal kernel path: every
  (query, key) block is computed, including the upper triangle and, packed, every other sample's
  blocks. Proposed (models/ or a small attention function registered with transformers'
  AttentionInterface): causal sdpa per sample, samples found from position_ids restarting at 0;
  right-padded unpacked rows need no mask at all under causal attention (a pad comes after every real
  token, so no real token can see one), i.e. one is_causal call for the whole batch.
- bfd_packing: data/packing.py pack_greedy is next-fit in dataset order: rows are 82 % full on this data
  (the rest is padding the model still computes). Proposed: best-fit decreasing (a pure function of the
  lengths too; the sampler shuffles rows anyway): 99.5 % full.
"""

from __future__ import annotations

import contextlib


def single_process_no_ddp() -> None:
    from llmtrain.backends import ddp

    real_ddp = ddp.DistributedDataParallel

    def maybe_ddp(model, **kwargs):
        import torch.distributed as dist
        return model if dist.get_world_size() == 1 else real_ddp(model, **kwargs)

    ddp.DistributedDataParallel = maybe_ddp
    original_no_sync = ddp.DDPEngine.no_sync

    def no_sync(self, is_last_micro_batch):
        if not isinstance(self.module, real_ddp):
            return contextlib.nullcontext()
        return original_no_sync(self, is_last_micro_batch)

    ddp.DDPEngine.no_sync = no_sync


def ddp_bucket_view() -> None:
    """backends/ddp.py: DistributedDataParallel(..., gradient_as_bucket_view=True): .grad become views into
    DDP's communication buckets instead of a second copy of every gradient (4M bytes fp32 per rank)."""
    from llmtrain.backends import ddp

    real_ddp = ddp.DistributedDataParallel
    ddp.DistributedDataParallel = lambda model, **kwargs: real_ddp(model, gradient_as_bucket_view=True, **kwargs)


def plain_console() -> None:
    import sys

    from llmtrain import run
    from llmtrain.metrics import sinks

    class LineConsole:
        def __init__(self, max_steps, start_step, every):
            self.max_steps, self.every = max_steps, every

        def log(self, record):
            step = record.get("step", 0)
            if "eval_loss" in record or (self.every and (step % self.every == 0 or step == 1)):
                print(("eval  " if "eval_loss" in record else "train ") + sinks._format(record),
                      file=sys.stderr, flush=True)

        def close(self):
            pass

    run.ConsoleSink = LineConsole


def best_fit_decreasing(lengths: list[int], max_seq_len: int) -> list[list[int]]:
    """Rows as full as possible: longest sample first, each into the fullest row it still fits in.
    Each row keeps its samples in index order; rows come out in order of their first sample."""
    import bisect

    free: list[tuple[int, int]] = []  # (space left, row id), sorted: the best fit is the first with room
    rows: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > max_seq_len:
            raise ValueError(f"sample {index} has {length} tokens > max_seq_len={max_seq_len}")
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            rows.append([index])
            bisect.insort(free, (max_seq_len - length, len(rows) - 1))
        else:
            space, row = free.pop(at)
            rows[row].append(index)
            bisect.insort(free, (space - length, row))
    return sorted((sorted(row) for row in rows), key=lambda row: row[0])


def bfd_packing() -> None:
    from llmtrain.data import dataset

    dataset.pack_greedy = best_fit_decreasing


SEGMENT_ATTENTION = "sdpa_segments"


def _segments(position_ids, T: int) -> list[tuple[int, int]]:
    """(start, end) of each sample of one row: a sample starts where position_ids restart at 0; the run of
    one-token segments at the end (padding: position 0 each) is one block, which no real token attends to."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    segments: list[list[int]] = []
    for a, e in zip(starts, starts[1:] + [T]):
        if segments and e - a == 1 and segments[-1][2]:
            segments[-1][1] = e
        else:
            segments.append([a, e, e - a == 1])
    return [(a, e) for a, e, _ in segments]


def segment_causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """query (B, H, T, D), key/value (B, KV, T, D) -> (B, T, H, D): causal attention inside each sample."""
    import torch
    import torch.nn.functional as F

    groups = getattr(module, "num_key_value_groups", 1)
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key  # (B, H, T, D), transformers' repeat_kv
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    B, _, T, _ = query.shape
    p = dropout if module.training else 0.0
    position_ids = kwargs.get("position_ids")
    if position_ids is None or T == 1:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=T > 1, dropout_p=p, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    position_ids = position_ids.expand(B, -1)
    if bool((position_ids[:, 1:] != 0).all()):  # one sample per row (unpacked, right-padded): one causal call
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=p, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    rows = []
    for b in range(B):
        parts = [F.scaled_dot_product_attention(query[b:b + 1, :, a:e], key[b:b + 1, :, a:e], value[b:b + 1, :, a:e],
                                                is_causal=e - a > 1, dropout_p=p, scale=scaling)
                 for a, e in _segments(position_ids[b], T)]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None  # (B, T, H, D)


def segment_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SEGMENT_ATTENTION, segment_causal_sdpa)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, lambda *args, **kwargs: None)  # no dense mask built
    from llmtrain import run
    from llmtrain.models import load

    resolve = load.resolve_attn_implementation

    def resolve_segments(requested, device):
        chosen = resolve(requested, device)
        return SEGMENT_ATTENTION if chosen == "sdpa" else chosen

    load.resolve_attn_implementation = resolve_segments
    if hasattr(run, "resolve_attn_implementation"):  # llmtrain.run binds the name at import
        run.resolve_attn_implementation = resolve_segments


PATCHES = {"segment_attention": segment_attention, "ddp_bucket_view": ddp_bucket_view, "single_process_no_ddp": single_process_no_ddp, "plain_console": plain_console,
           "bfd_packing": bfd_packing}


def apply(names: list[str]) -> list[str]:
    for name in names:
        PATCHES[name]()
    return names
