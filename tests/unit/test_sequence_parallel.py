"""Ulysses sequence parallelism without torchrun: the shard / shift / pad of a batch (data/sequence_shard.py), the sp
dimension of ParallelDims, and the checks that refuse what sp cannot run, before any model loads."""

import pytest
import torch
from transformers import AutoConfig

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.data.collate import collate
from llmtrain.data.packing import merge_packed
from llmtrain.data.sequence_shard import RowShare, pad_to_multiple, sequence_preparer, shard_batch
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.ulysses_checks import sp_model_problems
from llmtrain.parallel import ParallelDims
from llmtrain.validation import config_problems, data_parallel_size, validate


def _sample(start, length, prompt=0):
    ids = list(range(start, start + length))
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def _packed():
    """Row 0: samples of 5, 9, 3 tokens (width 17); row 1: 4 + 6 and a padding tail."""
    return collate([merge_packed([_sample(10, 5), _sample(20, 9, prompt=2), _sample(40, 3)]),
                    merge_packed([_sample(50, 4), _sample(60, 6)])], pad_token_id=0)


def _shards(batch, sp):
    return [sequence_preparer("sdpa_segments", RowShare(rank, sp))(batch) for rank in range(sp)]


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_targets_are_shifted_before_the_cut_and_counted_once(sp):
    batch = _packed()
    shards = _shards(batch, sp)
    width = -(-batch.width // sp) * sp
    whole_targets = torch.nn.functional.pad(batch.targets(), (0, width - batch.width), value=IGNORE_INDEX)
    assert torch.equal(torch.cat([s.labels for s in shards], dim=1), whole_targets)  # (B, T): shard by shard
    # the last token of shard 0 predicts the first token of shard 1: a target this rank never sees as input
    local = width // sp
    assert shards[0].labels[0, -1] == batch.labels[0, local]
    if sp == 2:  # the cut at 9 lies in the second sample's response: a real target
        assert shards[0].labels[0, -1] == shards[1].input_ids[0, 0] == batch.input_ids[0, local] != IGNORE_INDEX
    assert sum(s.num_targets for s in shards) == batch.num_targets
    assert all(s.shifted and s.targets() is s.labels for s in shards)


def test_packed_shards_keep_positions_and_the_whole_rows_segments():
    batch, sp = _packed(), 2
    shards = _shards(batch, sp)
    padded = torch.nn.functional.pad(batch.position_ids, (0, 1))  # width 17 -> 18, the tail's positions 0
    assert torch.equal(torch.cat([s.position_ids for s in shards], dim=1), padded)
    assert shards[1].position_ids[0, 0] == 4  # the 9-token sample starts at 5: position 9 - 5 = 4 on shard 1
    for shard in shards:  # segment lengths of the whole (padded) rows: after the all-to-all a rank holds whole rows
        assert shard.attention_kwargs["segment_lengths"] == ((5, 9, 3, 1), (4, 6, 8))
        assert shard.input_ids.shape == (2, 9) and shard.attention_mask is None
    assert [s.row_lengths for s in shards] == [(9, 9), (8, 1)]


def test_unpacked_rows_are_padded_and_get_whole_row_positions():
    batch = collate([_sample(1, 11), _sample(30, 6)], pad_token_id=0)  # width 11
    shards = _shards(batch, 2)
    assert [s.width for s in shards] == [6, 6]
    assert not any(s.is_packed for s in shards)  # no segments needed: causal over whole rows
    positions = torch.cat([s.attention_kwargs["position_ids"] for s in shards], dim=1)
    assert torch.equal(positions, torch.arange(12).expand(2, -1))
    assert torch.equal(shards[1].model_inputs()["position_ids"], torch.arange(6, 12).expand(2, -1))
    assert [s.row_lengths for s in shards] == [(6, 6), (5, 0)]


def test_padding_is_never_a_refusal_and_carries_no_loss():
    batch = collate([_sample(1, 7)], pad_token_id=0)
    padded = pad_to_multiple(batch, 4)
    assert padded.width == 8 and padded.labels[0, -1] == IGNORE_INDEX and padded.attention_mask[0, -1] == 0
    assert pad_to_multiple(padded, 4) is padded
    with pytest.raises(ValueError, match="not a multiple of sp=4"):
        shard_batch(batch.for_attention("sdpa_segments"), RowShare(0, 4))
    with pytest.raises(ValueError, match="already a shard"):
        shard_batch(_shards(padded, 2)[0], RowShare(0, 2))
    with pytest.raises(ValueError, match="dense"):
        shard_batch(pad_to_multiple(_packed(), 2).for_attention("sdpa"), RowShare(0, 2))


def test_parallel_dims_with_sp():
    dims = ParallelDims.build(8, sp=2)
    assert (dims.dp_shard, dims.sp, dims.dp_size) == (4, 2, 4)
    assert dims.fsdp_dim_names == ("dp_shard_sp",)
    assert ParallelDims.build(8, dp_replicate=2, sp=2).fsdp_dim_names == ("dp_replicate", "dp_shard_sp")
    assert str(ParallelDims.build(8, tp=2, sp=2)) == \
        "world 8 = dp_replicate 1 × dp_shard 2 × sp 2 × tp 2 (data parallel 2)"
    [message] = ParallelDims.problems(6, sp=4)
    assert "world size 6 divisible by backend.dp_replicate=1 × backend.sp=4 × backend.tp=1 = 4" in message
    [message] = ParallelDims.problems(8, dp_shard=2, sp=2)
    assert "backend.dp_replicate=1 × backend.dp_shard=2 × backend.sp=2 × backend.tp=1 = 4, not the world size 8" \
        in message
    assert ParallelDims.problems(4, sp=0)[0].startswith("backend.sp=0 must be >= 1")
    assert data_parallel_size(compose_config(["recipe=sft_tiny", "backend=zero2", "backend.sp=2"]).backend, 4) == 2


def _arch(heads=4, kv=2):
    return AutoConfig.for_model("llama", hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=kv)


def test_heads_checks():
    assert sp_model_problems(2, 1, _arch()) == []
    assert sp_model_problems(4, 1, _arch(kv=2)) == []  # 2 kv-heads for 4 sp ranks: each repeated twice
    assert sp_model_problems(2, 2, _arch(heads=8, kv=2)) == []  # tp 2 leaves 1 kv-head per rank: repeated
    [more] = sp_model_problems(4, 2, _arch())
    assert "backend.sp=4 × backend.tp=2 = 8 is more than the model's 4 query heads" in more
    [divide] = sp_model_problems(3, 1, _arch(heads=4, kv=4))
    assert "backend.sp=3 must divide the model's num_attention_heads=4" in divide and "[1, 2, 4]" in divide
    moe = AutoConfig.for_model("qwen2_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert "MoE model (qwen2_moe)" in sp_model_problems(2, 1, moe)[0]
    [kv] = sp_model_problems(4, 1, _arch(heads=12, kv=6))
    assert "6 kv-heads per tp rank" in kv and "pick backend.sp among [1, 2, 3, 6, 12]" in kv


def _refused(*overrides, world=2):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(["recipe=sft_tiny", "backend=zero2", "backend.sp=2", *overrides]), world_size=world)
    return str(error.value)


@pytest.mark.parametrize("recipe", ["grpo_tiny", "ppo_tiny"])
def test_stages_without_sp_are_refused_with_the_reason(recipe):
    message = _refused(f"recipe={recipe}")
    assert "generation is not sharded" in message and "set backend.sp=1" in message
    assert "runs stage=pretrain, stage=sft, stage=reward, stage=dpo, stage=simpo, stage=orpo" in message


@pytest.mark.parametrize("recipe", ["rm_tiny", "dpo_tiny", "simpo_tiny", "orpo_tiny"])
def test_pair_stages_validate_with_sp(recipe):
    """No problem at all for a pair stage under sp=2 (ZeRO-2 on 2 ranks, FSDP2 on 4), where the same recipe under
    sp=2 on 3 ranks is refused: the check ran on this config and passed it."""
    for backend, world in (("zero2", 2), ("fsdp2", 4)):
        cfg = compose_config([f"recipe={recipe}", f"backend={backend}", "backend.sp=2"])
        assert cfg.backend.sp == 2
        assert config_problems(cfg, world) == []
    stage = compose_config([f"recipe={recipe}"]).stage.name
    assert f"stage={stage}" in _refused("recipe=grpo_tiny")  # among the stages sp runs, the refusal lists
    assert "backend.sp=2" in _refused(f"recipe={recipe}", world=3)


def test_what_sp_cannot_honour_is_refused_before_loading():
    assert "model.attn_implementation=eager with backend.sp=2" in _refused("model.attn_implementation=eager")
    assert "model.dropout=0.1 with backend.sp=2" in _refused("model.dropout=0.1")
    assert "peft=lora with backend.sp=2: adapters over sequence shards" in _refused("peft=lora")
    family = _refused("model.from_config={model_type: gemma2, hidden_size: 64, num_attention_heads: 4, "
                      "num_key_value_heads: 2, intermediate_size: 128, num_hidden_layers: 2, head_dim: 16}")
    assert "gemma2 runs eager attention only" in family
    assert "backend.sp=2" in _refused(world=3)  # 3 ranks do not split into sp pairs
    validate(compose_config(["recipe=sft_tiny", "backend=fsdp2", "backend.sp=2"]), world_size=4)
    validate(compose_config(["recipe=pretrain_tiny", "backend=zero3", "backend.sp=2"]), world_size=2)


def test_pipeline_stages_over_sequence_shards_are_refused_together():
    """backend.pp and backend.sp each work; together they are untested, so refused before anything loads."""
    cfg = compose_config(["recipe=sft_tiny", "backend=fsdp2", "backend.pp=2", "backend.sp=2",
                          "trainer.grad_accum_steps=2", "trainer.eval_every_n_steps=0", "model.dropout=0.0"])
    with pytest.raises(ConfigError, match="backend.pp=2 with backend.sp=2: pipeline stages over sequence shards"):
        validate(cfg, world_size=4)
    [refused] = ParallelDims.problems(8, sp=2, pp=2)  # the layout itself refuses it, not only the run's checks
    assert refused.startswith("backend.pp=2 with backend.sp=2")
