"""Run under torchrun by tests/dist/test_sequence_parallel.py, 2 ranks, sp=2, for what the CLI runs cannot show:
`torchrun --nproc_per_node 2 -m tests.dist.workers.sequence_parallel_checks OUT_DIR` writes OUT_DIR/rank_<r>.json.

For each case, one tiny Llama twice with the same weights: whole rows through sdpa_segments (the reference), and
this rank's sequence shard through the Ulysses attention (models/ulysses.py). Compared: each shard token's log-prob
of its target, the loss summed over the sp group, and every gradient summed over the sp group (the all-to-all's
backward carries them).
- packed: rows of odd width (padded to a multiple of sp), a packed sample split by the shard cut;
- unpacked: right-padded rows of odd width;
- one kv-head (fewer than sp: replicated).
Also: each ulysses_attention call registers a name of its own, and leaves transformers' sdpa / sdpa_segments as
they were (no global swap).
Pairs (stages/pair_shard.py): one padding-free row of 3 pairs cut in two, the stages' own code on both models:
- reward: RewardStage.scores (each score read by the sp peer holding the sequence's last token, some on sp rank 1,
  summed over the peers) and the pairwise loss with center_coef (weighed by the shard's share);
- simpo: SimPOStage.logps (length-averaged: sums and target counts summed over the peers) and its loss;
each compared with the whole row: the scores / log-probs, the loss, and every gradient summed over the sp group.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)


def _batches():
    from llmtrain.data.collate import collate
    from llmtrain.data.packing import merge_packed

    def sample(start, length):
        ids = [(start + 7 * i) % 60 + 1 for i in range(length)]
        return {"input_ids": ids, "labels": ids}

    # row 0: samples 5 + 9 + 3 = 17 tokens (width 17, padded to 18: the cut at 9 falls inside the 9-token sample);
    # row 1: 4 + 6 tokens, and its padding tail
    packed = collate([merge_packed([sample(0, 5), sample(3, 9), sample(11, 3)]),
                      merge_packed([sample(5, 4), sample(2, 6)])], pad_token_id=0)
    unpacked = collate([sample(1, 11), sample(4, 6)], pad_token_id=0)  # width 11: padded to 12
    return {"packed": packed, "unpacked": unpacked}


def _token_logps(model, batch):
    """(B, T) log p of each position's target (0 where none) and their sum (−loss)."""
    import torch

    from llmtrain.losses.lm import IGNORE_INDEX

    logits = model(**batch.model_inputs()).logits.float()  # (B, T, V)
    targets = batch.targets()  # (B, T)
    keep = targets != IGNORE_INDEX
    logps = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0] * keep
    return logps, logps.sum()


def _case(kv_heads: int, batch, sp_rank: int, sp: int, group) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.data.sequence_shard import RowShare, sequence_preparer
    from llmtrain.models.ulysses import ulysses_attention

    config = AutoConfig.for_model("llama", num_key_value_heads=kv_heads, **SIZES)
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa_segments")
    name = ulysses_attention("sdpa_segments", sp, group)
    sharded = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
    sharded.load_state_dict(whole.state_dict())

    full = batch.for_attention("sdpa_segments")
    ref_logps, ref_sum = _token_logps(whole, full)
    (-ref_sum).backward()
    shard = sequence_preparer("sdpa_segments", RowShare(sp_rank, sp))(batch)
    logps, local_sum = _token_logps(sharded, shard)
    (-local_sum).backward()
    total = local_sum.detach().clone()
    dist.all_reduce(total, group=group)

    local = shard.width
    padded = torch.nn.functional.pad(ref_logps.detach(), (0, sp * local - full.width))  # (B, sp·T/sp)
    ref_part = padded[:, sp_rank * local:(sp_rank + 1) * local]
    grad_errors = []
    for (_, p_ref), (_, p_sp) in zip(whole.named_parameters(), sharded.named_parameters()):
        grad = p_sp.grad.clone()
        dist.all_reduce(grad, group=group)
        grad_errors.append(float((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp(min=1e-30)))
    return {"name": name, "width": full.width, "shard_width": local, "shard_targets": shard.num_targets,
            "whole_targets": full.num_targets, "logp_max_abs": float((logps.detach() - ref_part).abs().max()),
            "loss_rel": float(abs(total - ref_sum.detach()) / abs(ref_sum.detach())),
            "grad_max_rel": max(grad_errors)}


def _pair_batch():
    from llmtrain.losses.lm import IGNORE_INDEX
    from llmtrain.stages.preference import collate_pairs

    def side(length, prompt, start):
        ids = [(start + 5 * i) % 60 + 1 for i in range(length)]
        return ids, [IGNORE_INDEX] * prompt + ids[prompt:]

    examples = []
    for n, (chosen, rejected) in enumerate([(7, 5), (6, 9), (4, 8)]):  # 39 tokens: the cut at 20 is in a sequence
        (c_ids, c_labels), (r_ids, r_labels) = side(chosen, 2, 3 * n), side(rejected, 2, 3 * n + 1)
        examples.append({"chosen_input_ids": c_ids, "chosen_labels": c_labels, "rejected_input_ids": r_ids,
                         "rejected_labels": r_labels, "margin": 0.25 * n})
    return collate_pairs(examples, pad_token_id=0, padding_free=True)


def _pair_case(stage_name: str, sp_rank: int, sp: int, group) -> dict:
    """The stage's per-sequence values, loss and gradients on this rank's shard vs the whole row."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from llmtrain.data.sequence_shard import RowShare
    from llmtrain.losses.pairwise import pairwise_loss_sum
    from llmtrain.models.ulysses import ulysses_attention
    from llmtrain.stages.base import ModelSource
    from llmtrain.stages.reward import RewardStage
    from llmtrain.stages.simpo import SimPOStage

    reward = stage_name == "reward"
    config = AutoConfig.for_model("llama", num_key_value_heads=2, num_labels=1, pad_token_id=0, **SIZES)
    build = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    torch.manual_seed(1)
    whole = build.from_config(copy.deepcopy(config), attn_implementation="sdpa_segments")
    sharded = build.from_config(copy.deepcopy(config), attn_implementation=ulysses_attention("sdpa_segments", sp,
                                                                                              group))
    sharded.load_state_dict(whole.state_dict())
    source = ModelSource(None)
    stage = RewardStage(source, 0, center_coef=0.1, padding_free=True) if reward else \
        SimPOStage(source, 0, beta=2.0, gamma=0.5, padding_free=True)

    def values_and_loss(model, batch):
        if reward:
            chosen, rejected = stage.scores(SimpleNamespace(model=model), model, batch)
            return torch.cat([chosen, rejected]), pairwise_loss_sum(chosen, rejected, batch.margin, 0.1)
        logps = stage.logps(model, batch)
        return torch.cat(logps), stage.terms(logps).losses.sum()

    batch = _pair_batch()
    ref_values, ref_loss = values_and_loss(whole, batch.for_attention("sdpa_segments"))
    ref_loss.backward()
    shard = batch.sequence_shard("sdpa_segments", RowShare(sp_rank, sp, group))
    values, loss = values_and_loss(sharded, shard)
    (loss * shard.share).backward()  # as the stages weigh it: each pair's loss on one peer
    summed = (loss * shard.share).detach().clone()
    dist.all_reduce(summed, group=group)
    grad_errors = []
    for (_, p_ref), (_, p_sp) in zip(whole.named_parameters(), sharded.named_parameters()):
        grad = p_sp.grad.clone()
        dist.all_reduce(grad, group=group)
        grad_errors.append(float((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp(min=1e-30)))
    return {"ends_here": int((shard.ends >= 0).sum()), "width": batch.rows.width, "share": shard.share,
            "values_max_abs": float((values.detach() - ref_values.detach()).abs().max()),
            "loss_rel": float(abs(loss.detach() - ref_loss.detach()) / abs(ref_loss.detach())),
            "summed_loss_rel": float(abs(summed - ref_loss.detach()) / abs(ref_loss.detach())),
            "grad_max_rel": max(grad_errors)}


def worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AttentionInterface

    from llmtrain.distributed import init_distributed, shutdown
    from llmtrain.models.attention import register_segment_attention
    from llmtrain.parallel import ParallelDims

    ctx = init_distributed("cpu", 300)
    dims = ParallelDims.build(ctx.world_size, "cpu", sp=2)
    rows = dims.row_share()
    sp_rank, sp, group = rows.rank, rows.size, rows.group
    register_segment_attention()
    before = {k: AttentionInterface._global_mapping[k] for k in ("sdpa", "sdpa_segments")}
    batches = _batches()
    report = {"rank": ctx.rank, "sp_rank": sp_rank, "dp": dims.dp_size,
              "packed": _case(2, batches["packed"], sp_rank, sp, group),
              "unpacked": _case(2, batches["unpacked"], sp_rank, sp, group),
              "one_kv_head": _case(1, batches["packed"], sp_rank, sp, group),
              "reward": _pair_case("reward", sp_rank, sp, group), "simpo": _pair_case("simpo", sp_rank, sp, group)}
    after = {k: AttentionInterface._global_mapping[k] for k in ("sdpa", "sdpa_segments")}
    report["globals_unchanged"] = all(before[k] is after[k] for k in before)
    report["packed_cut_inside_sample"] = _cut_inside_sample(batches["packed"], sp)
    torch.set_num_threads(1)
    dist.barrier()
    (out_dir / f"rank_{ctx.rank}.json").write_text(json.dumps(report, indent=1))
    shutdown()


def _cut_inside_sample(batch, sp: int) -> bool:
    """Row 0's shard cut lies strictly inside one of its samples."""
    cut = -(-batch.width // sp)
    starts = [0]
    for length in batch.seq_lens[0]:
        starts.append(starts[-1] + length)
    return any(a < cut < b for a, b in zip(starts, starts[1:]))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    worker(out)
