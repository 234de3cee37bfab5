"""Context parallelism without torchrun: ring attention (models/ring_attention.py) against plain causal sdpa on whole
rows, forward and backward, zig-zag and contiguous chunks, GQA, packed rows, on cp gloo ranks spawned here; the
zig-zag shards of a batch (data/sequence_shard.py), which are torch's head-tail shards; what backend.cp and
backend.cp_implementation refuse before any model loads, and what `auto` picks (torch's ring itself runs on CUDA only:
tests/gpu/test_context_parallel.py)."""

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig

from llmtrain.compose import compose_config
from llmtrain.data.collate import collate
from llmtrain.data.packing import merge_packed
from llmtrain.data.sequence_shard import RowShare, row_multiple, sequence_preparer, shard_positions
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.ring_attention import CONTIGUOUS, ZIGZAG, chunk_count, chunks_of, ring_attention
from llmtrain.models.torch_context_parallel import torch_cp_positions
from llmtrain.parallel import ParallelDims
from llmtrain.parallel.cp import cp_implementation
from llmtrain.validation import config_problems

B, H, KV, D = 2, 4, 2, 8
CASES = [  # (layout, width: a multiple of 2·cp for cp 2 and 3, segment lengths per row or None)
    (ZIGZAG, 12, None),
    (CONTIGUOUS, 12, None),
    (ZIGZAG, 24, ((5, 9, 3, 7), (11, 13))),  # packed: samples cut by every chunk boundary
    (CONTIGUOUS, 24, ((5, 9, 3, 7), (24,))),
    (ZIGZAG, 24, ((24,), (20, 4))),  # pairs that one sample covers in every row (one call for all rows)
    (ZIGZAG, 24, ((6, 6, 6, 6), (6, 6, 6, 6))),  # at cp 2 a sample per chunk: pairs with no sample in common
]


def _reference(q, k, v, segments):
    """Causal sdpa over whole rows, within each packed sample: out (B, H, T, D)."""
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()[None].repeat(q.shape[0], 1, 1)
    if segments is not None:
        docs = torch.stack([torch.repeat_interleave(torch.arange(len(s)), torch.tensor(s)) for s in segments])
        mask &= docs[:, :, None] == docs[:, None, :]
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def _positions(rank, cp, layout, width):
    c = width // chunk_count(cp, layout)
    return torch.cat([torch.arange(a * c, (a + 1) * c) for a in chunks_of(rank, cp, layout)])


def _worker(rank, cp, port, failures):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    torch.manual_seed(0)
    try:
        for layout, width, segments in CASES:
            q, k, v = (torch.randn(B, n, width, D, dtype=torch.float64).float().requires_grad_() for n in (H, KV, KV))
            dout = torch.randn(B, H, width, D)
            ref = _reference(q, k, v, segments)
            ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
            mine = _positions(rank, cp, layout, width)  # (L,) this rank's tokens
            local = [x.detach()[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
            out = ring_attention(*local, group=None, layout=layout, segment_lengths=segments)
            grads = torch.autograd.grad(out, local, dout[:, :, mine])
            # the ranks' k/v gradients are this rank's tokens' whole gradients (every rank's queries included)
            errors = [float((out - ref[:, :, mine]).abs().max())] + \
                     [float((g - r[:, :, mine]).abs().max()) for g, r in zip(grads, ref_grads)]
            if max(errors) > 1e-5:
                failures.put(f"rank {rank} {layout} packed={segments is not None}: {errors}")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("cp", [2, 3])
def test_ring_matches_whole_row_attention(cp):
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(cp, _free_port(), failures), nprocs=cp)
    found = []
    while not failures.empty():
        found.append(failures.get())
    assert not found, found


def test_zigzag_balances_causal_work():
    """Key-query pairs each rank computes under causal masking, max / min over ranks: 1 with zig-zag chunks."""
    cp, width = 4, 64

    def work(layout):
        c = width // chunk_count(cp, layout)
        per_rank = []
        for r in range(cp):
            pairs = sum(c * c if b < a else c * (c + 1) // 2 if a == b else 0
                        for a in chunks_of(r, cp, layout) for s in range(cp) for b in chunks_of(s, cp, layout))
            per_rank.append(pairs)
        return max(per_rank) / min(per_rank)

    assert work(ZIGZAG) == 1.0
    assert work(CONTIGUOUS) == (3 * 16 * 16 + 16 * 17 // 2) / (16 * 17 // 2)  # rank 3 against rank 0: 6.6


def test_zigzag_shards_cover_each_row_once_in_order():
    """cp rank i holds chunks i and 2·cp−1−i, split contiguously over its sp peers; every position once."""
    assert shard_positions(8, 0, 2, cp=2).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 1, 2, cp=2).tolist() == [2, 3, 4, 5]
    assert shard_positions(16, 1, 4, cp=2).tolist() == [12, 13, 14, 15]  # cp rank 0, sp rank 1
    for size, cp in ((2, 2), (3, 3), (4, 2), (8, 4)):
        width = 4 * row_multiple(size, cp)
        held = torch.cat([shard_positions(width, r, size, cp) for r in range(size)])
        assert sorted(held.tolist()) == list(range(width))


def _sample(start, length, prompt=0):
    ids = list(range(start, start + length))
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def test_packed_zigzag_shards_keep_targets_positions_and_whole_row_segments():
    batch = collate([merge_packed([_sample(10, 5), _sample(20, 9, prompt=2), _sample(40, 3)]),
                     merge_packed([_sample(50, 4), _sample(60, 6)])], pad_token_id=0)  # widths 17: padded to 20
    shards = [sequence_preparer("sdpa_segments", RowShare(r, 2, cp=2))(batch) for r in range(2)]
    index = [shard_positions(20, r, 2, cp=2) for r in range(2)]
    targets = torch.nn.functional.pad(batch.targets(), (0, 3), value=IGNORE_INDEX)  # (B, 20)
    positions = torch.nn.functional.pad(batch.position_ids, (0, 3))
    for shard, mine in zip(shards, index):
        assert torch.equal(shard.labels, targets[:, mine]) and torch.equal(shard.position_ids, positions[:, mine])
        assert shard.attention_kwargs["segment_lengths"] == ((5, 9, 3, 3), (4, 6, 10))
    assert sum(s.num_targets for s in shards) == batch.num_targets


def _problems(*overrides, world=2):
    return config_problems(compose_config(["recipe=sft_tiny", "backend=fsdp2", "backend.cp=2", *overrides]), world)


def test_what_the_ring_cannot_run_is_refused_before_loading():
    assert _problems() == [] and _problems("backend.sp=2", world=4) == []
    assert "model.attn_implementation=eager with backend.cp=2" in _problems("model.attn_implementation=eager")[0]
    family = _problems("model.from_config={model_type: gemma2, hidden_size: 64, num_attention_heads: 4, "
                       "num_key_value_heads: 2, intermediate_size: 128, num_hidden_layers: 2, head_dim: 16}")
    assert any("gemma2 runs eager attention only" in p and "set backend.cp=1" in p for p in family)
    assert "backend.pp=2 with backend.cp=2" in " ".join(_problems("backend.pp=2", "trainer.grad_accum_steps=2",
                                                                  world=4))
    assert "peft=lora with backend.cp=2" in " ".join(_problems("peft=lora"))
    assert "set backend.cp=1" in " ".join(_problems("recipe=grpo_tiny"))
    dims = ParallelDims.build(4, cp=2)
    arch = AutoConfig.for_model("mistral", sliding_window=16, hidden_size=64, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2)
    assert "sliding-window layers (16 tokens)" in dims.model_problems(None, lambda: arch)[0]
    assert str(dims) == "world 4 = dp_replicate 1 × dp_shard 2 × cp 2 × tp 1 (data parallel 2)"


def test_planned_ring_bytes_are_the_ones_counted_live():
    """parallel/cp.collectives at a rank's tokens of one micro-batch (8 rows × 32, cp 2, 2 layers, 2 kv-heads × 16,
    accumulation 2, fp32) = the sends tests/dist/test_sequence_parallel.py counts live on fsdp2_cp2: 1,048,576 bytes."""
    from types import SimpleNamespace

    from llmtrain.parallel.cp import collectives

    facts = SimpleNamespace(kv_heads=2, hidden=64, heads=4, layers=2)
    planned = collectives(SimpleNamespace(cp=2, tp=1), facts, "fp32", tokens_per_micro=8 * 32, accum=2,
                          trainable=True, checkpointing=False)
    assert sum(c.wire for c in planned) == 1_048_576


def test_torch_head_tail_cut_is_the_zigzag_shard():
    """torch's `_HeadTailLoadBalancer` order, cut as DTensor's Shard(seq) cuts it, is sequence_shard's zig-zag index
    for index: backend.cp_implementation=torch attends on the shards llmtrain cuts on the host."""
    for cp in (2, 3, 4):
        for width in (2 * cp, 6 * cp):
            for rank in range(cp):
                assert torch_cp_positions(width, rank, cp).tolist() == shard_positions(width, rank, cp, cp).tolist()


def test_auto_picks_the_ring_until_torchs_path_has_run_on_a_gpu():
    """auto is the ring everywhere (torch's context parallelism has not run on a GPU here yet); torch and ring are
    taken as asked (torch refused where it cannot run: the test below)."""
    auto, ring, torch_cp = (SimpleNamespace(cp_implementation=name) for name in ("auto", "ring", "torch"))
    assert cp_implementation(auto) == "ring" and cp_implementation(SimpleNamespace()) == "ring"  # absent: auto
    assert cp_implementation(ring) == "ring"
    assert cp_implementation(torch_cp) == "torch"


def test_torch_context_parallel_is_refused_where_it_cannot_run():
    torch_cp = "backend.cp_implementation=torch"
    on_cpu = _problems(torch_cp)
    assert len(on_cpu) == 1 and on_cpu[0].startswith(f"{torch_cp} with backend.cp=2: on cpu")
    assert "set backend.cp_implementation=ring" in on_cpu[0]
    zero2 = config_problems(compose_config(["recipe=sft_tiny", "backend=zero2", "backend.cp=2", torch_cp]), 2)
    assert len(zero2) == 1 and zero2[0].startswith(f"{torch_cp} with backend.cp=2: on cpu")
    assert _problems("device=cuda", torch_cp) == []
    assert "data.packing=true puts several samples" in " ".join(_problems("device=cuda", torch_cp, "data.packing=true"))
    assert "backend.sp=2: torch's ring" in " ".join(_problems("device=cuda", torch_cp, "backend.sp=2", world=4))
    assert "backend.cp_implementation=flash: not one of auto | ring | torch" in _problems(
        "backend.cp_implementation=flash")[0]
    no_cp = config_problems(compose_config(["recipe=sft_tiny", "backend=fsdp2", torch_cp]), 2)
    assert len(no_cp) == 1 and "backend.cp=1: there is no context parallelism to run" in no_cp[0]
