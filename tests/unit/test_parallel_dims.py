"""ParallelDims and the fsdp2 pre-load checks: pure arithmetic on degrees and architecture configs."""

from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from llmtrain.backends import backend_model_problems, backend_problems
from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.parallel import ParallelDims
from llmtrain.parallel.tp import divisibility_problems
from llmtrain.validation import data_parallel_size, validate


def model_check(backend, world_size: int, arch) -> list[str]:
    return backend_model_problems(backend, world_size, lambda: arch)

EVERY_DEGREE = ("backend.dp_replicate=", "backend.dp_shard=", "backend.tp=")


def arch(model_type="llama", **fields):
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    if model_type == "gpt2":
        sizes = dict(n_embd=64, n_head=4)
    return AutoConfig.for_model(model_type, **{**sizes, **fields})


def backend(**fields):
    return SimpleNamespace(**{"name": "fsdp2", "dp_replicate": 1, "dp_shard": -1, "tp": 1, **fields})


@pytest.mark.parametrize("dp_replicate,dp_shard,tp,world,resolved", [
    (1, -1, 1, 8, (1, 8, 1)),
    (1, -1, 2, 8, (1, 4, 2)),
    (2, -1, 1, 16, (2, 8, 1)),
    (2, 2, 2, 8, (2, 2, 2)),
    (1, 1, 1, 1, (1, 1, 1)),
])
def test_degrees_resolve(dp_replicate, dp_shard, tp, world, resolved):
    dims = ParallelDims.build(world, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == resolved
    assert dims.dp_size == resolved[0] * resolved[1] == world // tp


@pytest.mark.parametrize("dp_replicate,dp_shard,tp,world,needle", [
    (1, 2, 2, 2, "= 4, not the world size 2"),  # dp × tp != world
    (1, -1, 3, 4, "world size 4 divisible by"),
    (2, -1, 1, 3, "world size 3 divisible by"),
    (1, 0, 1, 2, "backend.dp_shard=0 must be >= 1, or -1"),
    (1, -1, 0, 2, "backend.tp=0 must be >= 1"),
])
def test_bad_degrees_name_every_degree(dp_replicate, dp_shard, tp, world, needle):
    with pytest.raises(ConfigError) as error:
        ParallelDims.build(world, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    message = str(error.value)
    assert needle in message and f"world size {world}" in message, message
    assert all(name in message for name in ("backend.dp_replicate=", "backend.tp=")), message


def test_mismatch_message_prints_every_degree():
    [message] = ParallelDims.problems(8, dp_replicate=2, dp_shard=3, tp=2)
    assert all(name in message for name in EVERY_DEGREE)
    assert "backend.dp_replicate=2 × backend.dp_shard=3 × backend.tp=2 = 12" in message


def test_tp_must_divide_heads_kv_heads_and_mlp():
    dims = ParallelDims.build(3, tp=3)
    problems = divisibility_problems(dims, "llama", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "intermediate_size": 128})
    assert [p.split(" (")[0] for p in problems] == [
        "backend.tp=3 must divide the model's num_attention_heads=4",
        "backend.tp=3 must divide the model's num_key_value_heads=2",
        "backend.tp=3 must divide the model's intermediate_size=128"]
    assert all(name in problems[0] for name in EVERY_DEGREE) and "pick a tp among [1, 2]" in problems[0]
    # GQA: 8 heads, 2 kv-heads -> tp=4 splits the query heads but not the kv-heads
    gqa = divisibility_problems(ParallelDims.build(4, tp=4), "qwen2", {"num_attention_heads": 8,
                                                                         "num_key_value_heads": 2,
                                                                         "intermediate_size": 128})
    assert len(gqa) == 1 and "num_key_value_heads=2" in gqa[0]


def test_fsdp2_model_check_on_architectures():
    check = model_check
    assert check(backend(tp=2), 4, arch("llama")) == []
    assert check(backend(tp=2), 2, arch("qwen2")) == []
    assert check(backend(tp=1), 2, arch("gpt2")) == []  # plain FSDP2 shards any architecture
    [gpt2] = check(backend(tp=2), 2, arch("gpt2"))
    assert "backend.tp=2" in gpt2 and "'gpt2'" in gpt2 and "no tensor-parallel plan" in gpt2
    assert "backend=ddp" in gpt2 and "backend=fsdp2 (backend.tp=1)" in gpt2
    assert len(check(backend(tp=4), 4, arch("llama"))) == 1  # 4 heads ok, 2 kv-heads not
    assert check(backend(tp=2, dp_shard=3), 2, arch("llama")) == []  # the layout error is reported elsewhere


def test_fsdp2_config_check_through_validate():
    assert backend_problems(backend(tp=2), 4) == []
    cfg = compose_config(["recipe=sft_tiny", "backend=fsdp2_tp", "backend.dp_shard=4"])
    with pytest.raises(ConfigError, match=r"backend\.dp_shard=4 × backend\.tp=2 = 8, not the world size 4"):
        validate(cfg, world_size=4)
    validate(compose_config(["recipe=sft_tiny", "backend=fsdp2_tp"]), world_size=4)


def test_tp_peers_share_data():
    cfg = compose_config(["recipe=sft_tiny", "backend=fsdp2_tp"])
    assert data_parallel_size(cfg.backend, 8) == 4
    assert data_parallel_size(compose_config(["recipe=sft_tiny", "backend=fsdp2"]).backend, 8) == 8
    cfg = compose_config(["recipe=sft_tiny", "backend=fsdp2_tp", "trainer.global_batch_size=64",
                          "trainer.micro_batch_size=8", "trainer.grad_accum_steps=2"])
    validate(cfg, world_size=8)  # 8 × 2 × dp 4


def test_mesh_dims():
    assert ParallelDims.build(8, tp=2).dp_dim_names == ("dp_shard",)
    assert ParallelDims.build(8, dp_replicate=2).dp_dim_names == ("dp_replicate", "dp_shard")
    assert str(ParallelDims.build(8, dp_replicate=2, tp=2)) == \
        "world 8 = dp_replicate 2 × dp_shard 2 × tp 2 (data parallel 4)"


def test_fsdp2_model_check_on_the_families_tp_styles():
    """qk-norms, Phi-3's gathered fused projections and MoE experts are mapped; experts must split evenly over tp;
    a style nobody maps is refused by name."""
    check = model_check
    for family, fields in [("qwen3", {}), ("gemma3_text", {}), ("phi3", {}),
                           ("mixtral", {"num_local_experts": 4}), ("qwen3_moe", {"num_experts": 4})]:
        assert check(backend(tp=2), 2, arch(family, **fields)) == [], family
    [experts] = check(backend(tp=2), 2, arch("mixtral", num_local_experts=3))
    assert "backend.tp=2 must divide the model's 3 experts" in experts and "backend=ddp" in experts
    odd = arch("llama")
    odd.base_model_tp_plan = {**odd.base_model_tp_plan, "layers.*.self_attn.o_proj": "rowwise_rep"}
    [unknown] = check(backend(tp=2), 2, odd)
    assert "style(s) rowwise_rep, which llmtrain does not map" in unknown


@pytest.mark.parametrize("tp_entries,ep_entries", [
    ({"layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlp.experts.down_proj": "rowwise"}, {}),  # transformers 5.24
    ({}, {"layers.*.mlp.experts": "ep_dispatch_experts", "layers.*.mlp.experts.down_proj": "grouped_gemm"}),  # 5.25
])
def test_experts_split_over_tp_whichever_plan_names_them(tp_entries, ep_entries):
    """The experts module is split over tp whether transformers names it in the tp plan (up to 5.24) or in the ep plan
    (5.25 on)."""
    from llmtrain.models.tp import module_plan, tp_plan

    attention = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    config = SimpleNamespace(model_type="mixtral", base_model_tp_plan={**attention, **tp_entries},
                             base_model_ep_plan=ep_entries)
    assert module_plan(tp_plan(config)) == {**attention, "layers.*.mlp.experts": "moe_tp_experts"}


def test_experts_that_are_not_routed_experts_are_refused_under_tp():
    """Llama-4's experts take tokens pre-sorted per expert, not transformers' routed call that the experts style wraps:
    tp > 1 is refused before any weight loads, naming the module and what works."""
    check = model_check
    llama4 = arch("llama4_text", intermediate_size_mlp=128, num_hidden_layers=2, num_local_experts=4)
    [refused] = check(backend(tp=2), 2, llama4)
    assert "Llama4TextExperts is not called the way transformers' routed experts are" in refused
    assert "backend=ddp" in refused and check(backend(tp=1), 2, llama4) == []


def test_the_planner_counts_the_experts_among_the_tp_split_parameters():
    """Mixtral from its config: the tp-split parameters are attention's four projections and the stacked experts of
    every layer (counted from the meta model by name); the router and the norms stay replicated."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.models.facts import model_facts

    cfg = compose_config(["recipe=sft_tiny", "model.name_or_path=null",
                          "model.from_config={model_type:mixtral,num_local_experts:4,"
                          "hidden_size:32,intermediate_size:64,num_hidden_layers:2,num_attention_heads:4,"
                          "num_key_value_heads:2}"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg.model.from_config))
    split = ("q_proj.", "k_proj.", "v_proj.", "o_proj.", "experts.")
    expected = sum(p.numel() for name, p in model.named_parameters() if any(part in name for part in split))
    assert expected > 2 * 4 * 3 * 64 * 32  # the experts are in it
    assert model_facts(cfg).tp_params == expected
