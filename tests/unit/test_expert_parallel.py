"""The pure parts of models/expert_parallel.py: the checks that refuse a layout before any model loads, and the
figures the planner and the live cost meter read (per-rank expert parameters, all-to-all bytes)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from llmtrain.models.expert_parallel import (
    all_to_all_bytes,
    efsdp_size,
    ep_problems,
    expert_params_per_rank,
    moe_layers,
)

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def mixtral(experts: int = 8):
    return AutoConfig.for_model("mixtral", num_local_experts=experts, num_experts_per_tok=2, **SIZES)


def qwen2_moe(**extra):
    return AutoConfig.for_model("qwen2_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=48, **SIZES, **extra)


def test_a_layout_that_fits_has_no_problem():
    assert ep_problems(mixtral(), 1) == []
    assert ep_problems(mixtral(), 4, tp=2) == []
    assert ep_problems(qwen2_moe(), 2) == []


def test_a_dense_model_is_refused_naming_the_fix():
    [problem] = ep_problems(AutoConfig.for_model("llama", **SIZES), 2)
    assert "backend.ep=2" in problem and "dense" in problem and "set backend.ep=1" in problem


def test_ep_must_divide_the_experts():
    [problem] = ep_problems(qwen2_moe(), 4)
    assert "backend.ep=4 must divide the model's 6 experts" in problem and "[2, 3, 6]" in problem


def test_ep_must_be_a_multiple_of_tp_and_divide_dp_shard_times_tp():
    from llmtrain.parallel.dimension import with_defaults
    from llmtrain.parallel.ep import problems

    degrees = with_defaults({"ep": 2, "tp": 4, "dp_shard": 1})  # every other degree at its default
    [problem] = problems(None, degrees)
    assert "backend.ep=2 must be a multiple of backend.tp=4" in problem and "multiples of 4" in problem
    [problem] = problems(None, {**degrees, "ep": 8, "tp": 2, "dp_shard": 2})
    assert "backend.ep=8 must divide backend.dp_shard × backend.tp = 4" in problem


def test_lora_beside_split_experts_is_refused():
    from omegaconf import OmegaConf

    from llmtrain.models.lora_checks import peft_problems

    peft = OmegaConf.create({"name": "lora", "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"})
    [problem] = peft_problems(peft, OmegaConf.create({"name": "fsdp2", "tp": 1, "ep": 2}))
    assert "peft=lora with backend.ep=2" in problem and "use backend.ep=1" in problem
    assert peft_problems(peft, OmegaConf.create({"name": "fsdp2", "tp": 1, "ep": 1})) == []


def test_efsdp_is_what_ep_leaves_of_dp_shard_times_tp():
    assert efsdp_size(dp_shard=4, tp=2, ep=4) == 2  # transformers' docstring example: fsdp 4, tp 2, ep 4
    assert efsdp_size(dp_shard=2, tp=1, ep=2) == 1
    assert efsdp_size(dp_shard=4, tp=2, ep=2) == 4  # ep = tp: efsdp = dp_shard


def test_moe_layers_follow_the_sparse_step_and_dense_layers():
    assert moe_layers(mixtral()) == 4
    assert moe_layers(qwen2_moe(decoder_sparse_step=2)) == 2  # layers 1 and 3
    assert moe_layers(qwen2_moe(mlp_only_layers=[0])) == 3


def test_expert_params_per_rank():
    per_expert = 3 * 64 * 32  # gate_up (2I, h) + down (h, I), Mixtral's I = intermediate_size
    assert expert_params_per_rank(mixtral(), 1) == 4 * 8 * per_expert
    assert expert_params_per_rank(mixtral(), 4) == 4 * 2 * per_expert
    assert expert_params_per_rank(mixtral(), 4, efsdp=2) == 4 * 1 * per_expert
    assert expert_params_per_rank(mixtral(), 8, efsdp=2) == 4 * 1 * per_expert  # 1 expert over 2: padded to 2 rows
    assert expert_params_per_rank(qwen2_moe(), 3) == 4 * 2 * 3 * 16 * 32  # moe_intermediate_size


def test_all_to_all_bytes():
    layer = 8 * 8 + 2 * (64 * 2 * 32 * 4) + 2 * (64 * 2 * 32 * 4)  # counts; rows out and back; their gradients
    assert all_to_all_bytes(mixtral(), 64, ep=2) == 4 * layer
    assert all_to_all_bytes(mixtral(), 64, ep=1) == 0
    assert all_to_all_bytes(mixtral(), 128, ep=2, tp=2) == 4 * layer  # tp peers share 128 tokens, 64 each
    recomputed = 4 * (2 * (8 * 8 + 2 * 64 * 2 * 32 * 4) + 2 * 64 * 2 * 32 * 4)
    assert all_to_all_bytes(mixtral(), 64, ep=2, recompute=True) == recomputed
    assert all_to_all_bytes(mixtral(), 64, ep=2, element_bytes=2) < all_to_all_bytes(mixtral(), 64, ep=2)


@pytest.mark.parametrize("ep", [0, -2])
def test_a_degree_below_one_is_refused(ep):
    from llmtrain.parallel.layout import ParallelDims

    assert f"backend.ep={ep} must be >= 1" in " ".join(ParallelDims.problems(4, ep=ep))


# ---- the dimension (parallel/ep.py) through the run's checks and the planner --------------------------------------

MIXTRAL_TINY = ("model.from_config={model_type:mixtral,hidden_size:64,intermediate_size:128,num_hidden_layers:2,"
                "num_attention_heads:4,num_key_value_heads:2,num_local_experts:4,num_experts_per_tok:2}")


def _refusal(overrides: list[str], world: int) -> str:
    """The run's checks before any weight loads: validation, then the model's config against the layout."""
    from llmtrain.compose import compose_config
    from llmtrain.config import ConfigError
    from llmtrain.plan.core import check_backend_against_model
    from llmtrain.validation import validate

    with pytest.raises(ConfigError) as error:
        cfg = compose_config(["recipe=sft_tiny", *overrides])  # a field the chosen backend lacks: refused here
        validate(cfg, world_size=world)
        check_backend_against_model(cfg, world)
    return str(error.value)


def test_the_run_refuses_ep_before_loading_naming_the_fix():
    """backend.ep on a dense model, not dividing the experts, beside sp, and on DeepSpeed (whose MoE layer is not
    transformers' experts module): each refused before any weight loads, from the config and config.json alone."""
    assert "is a dense model" in _refusal(["backend=fsdp2", "backend.ep=2"], 2)
    assert "must divide the model's 4 experts" in _refusal(["backend=fsdp2", "backend.ep=3", MIXTRAL_TINY], 3)
    assert "backend.ep=2 with backend.sp=2" in _refusal(["backend=fsdp2", "backend.ep=2", "backend.sp=2",
                                                          MIXTRAL_TINY], 4)
    assert "DeepSpeed's MoE layer is not transformers' experts module" in _refusal(
        ["backend=zero3", "backend.ep=2", MIXTRAL_TINY], 2)


def test_ep_leaves_the_data_parallel_size_alone():
    """ep is carved from dp_shard × tp: 4 ranks at ep 2 still read 4 batches (sp and pp would divide them)."""
    from llmtrain.parallel import ParallelDims

    dims = ParallelDims.build(4, ep=2)
    assert (dims.dp_size, dims.ep, str(dims)) == (4, 2, "world 4 = dp_replicate 1 × dp_shard 4 × tp 1 (ep 2) "
                                                        "(data parallel 4)")
    assert ParallelDims.build(4, tp=2, ep=4).dp_size == 2
    assert ParallelDims.problems(4, tp=2, ep=3)[0].startswith("backend.ep=3 must be a multiple of backend.tp=2")


def test_the_plan_of_qwen3_30b_a3b_fits_8_h200_with_ep_and_not_without():
    """recipe=sft_qwen3_30b_a3b (config.json shipped): at ep 8 a rank holds 16 of 128 experts of each of 48 layers
    (28.99 B / 8 expert parameters) and the run fits an H200; at ep 1, FSDP2 keeps every expert's gradient whole
    between micro-batches (no_sync) and it does not."""
    from llmtrain.compose import compose_config
    from llmtrain.plan.report import plan_text

    base = ["recipe=sft_qwen3_30b_a3b", "plan.world_size=8", "plan.gpu=h200"]
    with_ep = plan_text(compose_config(base))
    assert "fsdp2: ep 8 × efsdp 1: 16 of 128 experts per rank in each of 48 MoE layers (3.62 B of 28.99 B" in with_ep
    assert "fsdp2: fits at micro-batch 2" in with_ep
    assert "fsdp2: does NOT fit at micro-batch 2" in plan_text(compose_config([*base, "backend.ep=1"]))
