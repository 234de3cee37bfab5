"""Pipeline parallelism without torchrun: the split of the blocks by cost, the stage copies of an HF decoder (names,
keys, forward), the pp dimension of ParallelDims, and every pre-load refusal (field and fix named)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmtrain.backends import backend_model_problems, data_parallel_size
from llmtrain.backends.pipeline import PipelineIdentity, stage_copy
from llmtrain.backends.pipeline_checks import StageCosts, describe_stage, rank_stages, split_blocks, stage_ranks
from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.parallel import ParallelDims
from llmtrain.validation import config_problems


def model_check(backend, world_size: int, arch) -> list[str]:
    return backend_model_problems(backend, world_size, lambda: arch)

# ---- the split ---------------------------------------------------------------------------------------------------


def test_even_blocks_split_evenly_and_every_stage_gets_one():
    costs = StageCosts(block=1.0, embed=0.0, head=0.0)
    assert split_blocks(8, 4, costs) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_blocks(3, 3, costs) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="2 decoder blocks cannot fill 3"):
        split_blocks(2, 3, costs)


def test_a_costly_head_moves_blocks_off_the_last_stage():
    """Head = 3 blocks: the last stage holds 3 blocks + head (6) and the first 5 blocks (5): max 6, not 4 + 3 = 7."""
    assert split_blocks(8, 2, StageCosts(block=1.0, embed=0.0, head=3.0)) == [range(0, 5), range(5, 8)]
    # a costly embedding moves them the other way
    assert split_blocks(8, 2, StageCosts(block=1.0, embed=2.0, head=0.0)) == [range(0, 3), range(3, 8)]


def test_looped_and_v_shaped_placements():
    assert [rank_stages(r, 2, 4) for r in range(2)] == [[0, 2], [1, 3]]
    assert [rank_stages(r, 4, 8, v_shape=True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(stage_ranks(s, 4, True) == r for r in range(4) for s in rank_stages(r, 4, 8, v_shape=True))


def test_costs_follow_the_flops_model():
    costs = StageCosts.of(block_params=1000, hidden=16, vocab=100, seq_len=32, head_params=1600)
    assert costs.block == 6 * 1000 + 12 * 16 * 32 and costs.head == 6 * 1600 + 2 * 16 and costs.embed == 2 * 16


def test_stage_descriptions():
    assert describe_stage(0, 2, range(0, 14)) == "embed + blocks 0-13"
    assert describe_stage(1, 2, range(14, 28)) == "blocks 14-27 + norm + head"
    assert describe_stage(1, 3, range(5, 6)) == "block 5"


# ---- stage copies of an HF decoder ---------------------------------------------------------------------------------

def tiny_llama(layers=4):
    torch.manual_seed(0)
    arch = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_key_value_heads=2, num_hidden_layers=layers, vocab_size=50,
                                tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(arch, attn_implementation="sdpa").eval()


def test_stage_copies_keep_the_whole_models_keys_once():
    model = tiny_llama()
    bounds = [range(0, 1), range(1, 3), range(3, 4)]
    copies = [stage_copy(model, b, i == 0, i == 2) for i, b in enumerate(bounds)]
    keys = [k for c in copies for k in c.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())  # every key, once: checkpoints and exports keep the names
    assert isinstance(copies[0].model.layers[2], PipelineIdentity) and copies[0].lm_head is None
    assert copies[1].model.embed_tokens is None and isinstance(copies[1].model.norm, torch.nn.Identity)
    assert copies[2].model.layers[3].self_attn.q_proj.weight is not model.model.layers[3].self_attn.q_proj.weight


def test_stages_in_sequence_give_the_models_logits():
    model = tiny_llama()
    bounds = [range(0, 2), range(2, 4)]
    first, last = (stage_copy(model, b, i == 0, i == 1) for i, b in enumerate(bounds))
    ids = torch.randint(0, 50, (2, 7))  # (B, T)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        hidden = first.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, h)
        logits = last(inputs_embeds=hidden, attention_mask=mask).logits  # (B, T, V)
        torch.testing.assert_close(logits, model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=1e-6)


# ---- the pp dimension ------------------------------------------------------------------------------------------------

def test_pp_takes_its_share_of_the_world():
    dims = ParallelDims.build(8, pp=2)
    assert (dims.pp, dims.dp_shard, dims.dp_size) == (2, 4, 4)
    assert dims.degrees == {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "sp": 1, "tp": 1, "ep": 1}
    assert "pp 2 × " in str(dims)
    [message] = ParallelDims.problems(6, pp=4)
    assert "world size 6 divisible by backend.pp=4 × backend.dp_replicate=1 × backend.tp=1 = 4" in message
    [message] = ParallelDims.problems(8, dp_shard=2, pp=2)
    assert "backend.pp=2 × backend.dp_replicate=1 × backend.dp_shard=2 × backend.tp=1 = 4" in message
    cfg = compose_config(["recipe=sft_tiny", "backend=fsdp2", "backend.pp=2"])
    assert data_parallel_size(cfg.backend, 8) == 4  # stages of one pipeline read the same examples


# ---- refusals before anything loads ------------------------------------------------------------------------------

PP2 = ["backend=fsdp2", "backend.pp=2", "trainer.grad_accum_steps=2", "trainer.eval_every_n_steps=0"]


def problems(*overrides, world=2, recipe="sft_tiny"):
    return "\n".join(config_problems(compose_config([f"recipe={recipe}", *overrides]), world))


def test_a_valid_pipeline_config_passes():
    assert problems(*PP2) == ""
    assert problems(*PP2, "backend.pp_schedule=interleaved_1f1b", "backend.pp_virtual_stages=2") == ""
    assert problems(*PP2, "backend.pp_schedule=interleaved_1f1b", "backend.pp_virtual_stages=2",
                    "trainer.grad_accum_steps=3") == ""  # one round of 3 (torch's rule)
    assert problems(*PP2, "backend.pp_schedule=gpipe", "trainer.grad_accum_steps=1", world=4) == ""
    assert problems(*PP2, "backend.tp=2", world=4) == ""  # pp 2 × tp 2
    zero_bubble = ["backend.reshard_after_forward=false", "backend.pp_virtual_stages=2"]
    assert problems(*PP2, "backend.pp_schedule=zb", *zero_bubble) == ""
    assert problems(*PP2, "backend.pp_schedule=zb", "backend.reshard_after_forward=false") == ""  # ZB1P: v 1
    assert problems(*PP2, "backend.pp_schedule=zbv", *zero_bubble, "trainer.grad_accum_steps=3") == ""  # no rounds


@pytest.mark.parametrize("overrides,world,needle", [
    (["backend.pp=3"], 2, "backend.pp=3 × backend.dp_replicate=1 × backend.tp=1 = 3"),
    (["trainer.grad_accum_steps=1"], 2, "trainer.grad_accum_steps=1 < backend.pp=2: 1f1b"),
    (["backend.pp_schedule=interleaved_1f1b"], 2, "set backend.pp_virtual_stages >= 2"),
    (["backend.pp_virtual_stages=2"], 2, "backend.pp_virtual_stages=2 needs backend.pp_schedule=interleaved_1f1b, zb"),
    (["backend.pp_schedule=interleaved_1f1b", "backend.pp_virtual_stages=2", "trainer.grad_accum_steps=5"], 2,
     "trainer.grad_accum_steps=5 does not split into 2 equal rounds for interleaved_1f1b"),
    (["backend.pp_schedule=zb"], 2, "backend.pp_schedule=zb splits each backward into an input pass and a later "
     "weight pass"),  # default reshard_after_forward=true: blocks' weight gradients lost (tests/dist/test_pipeline.py)
    (["backend.pp_schedule=zbv", "backend.pp_virtual_stages=2"], 2, "set backend.reshard_after_forward=false"),
    (["backend.pp_schedule=zbv", "backend.reshard_after_forward=false"], 2,
     "backend.pp_schedule=zbv (ScheduleZBVZeroBubble) places exactly 2 stages per rank in a V"),
    (["backend.pp_schedule=zbv", "backend.pp_virtual_stages=3", "backend.reshard_after_forward=false"], 2,
     "set backend.pp_virtual_stages=2 (it is 3)"),
    (["backend.pp_schedule=zb", "backend.pp_virtual_stages=2", "backend.reshard_after_forward=false",
      "trainer.grad_accum_steps=5"], 2, "does not split into 2 equal rounds for zb (torch's ScheduleInterleavedZero"),
    (["backend.pp_schedule=zbv", "backend.pp_virtual_stages=2", "backend.reshard_after_forward=false",
      "trainer.grad_accum_steps=1"], 2, "trainer.grad_accum_steps=1 < backend.pp=2: zbv"),
    (["backend.pp_schedule=dualpipe"], 2, "backend.pp_schedule=dualpipe is not one of gpipe, 1f1b"),
    (["backend.tp=2"], 2, "world size 2 divisible by backend.pp=2 × backend.dp_replicate=1 × backend.tp=2 = 4"),
    (["backend.compile=true"], 2, "backend.compile=true is not tested yet"),
    (["precision=fp16"], 2, "precision=fp16 with backend.pp=2"),
])
def test_pipeline_refusals_name_the_field_and_the_fix(overrides, world, needle):
    assert needle in problems(*PP2, *overrides, world=world)


@pytest.mark.parametrize("recipe,extra", [("rm_tiny", []), ("simpo_tiny", []), ("orpo_tiny", []),
                                          ("dpo_tiny", ["dpo.precompute_ref_logps=true"])])
def test_pair_stages_pass_the_pipeline_checks(recipe, extra):
    assert problems(*PP2, *extra, recipe=recipe) == ""


def test_dpo_under_pp_refuses_the_in_step_reference_and_builds_no_reference_role():
    from llmtrain.stages.base import ModelSource
    from llmtrain.stages.dpo import dpo_roles

    found = problems(*PP2, recipe="dpo_tiny")
    assert "stage=dpo with backend.pp=2 computes the reference log-probs once" in found
    assert "set dpo.precompute_ref_logps=true, or backend.pp=1" in found
    source = ModelSource("x")
    cfg = compose_config(["recipe=dpo_tiny", *PP2, "dpo.precompute_ref_logps=true"])
    assert list(dpo_roles(cfg, source)) == ["policy"]  # what the planner counts
    assert list(dpo_roles(compose_config(["recipe=dpo_tiny"]), source)) == ["policy", "reference"]


@pytest.mark.parametrize("recipe,stage", [("grpo_tiny", "grpo"), ("ppo_tiny", "ppo")])
def test_rollout_stages_are_refused_with_the_alternative(recipe, stage):
    found = problems(*PP2, recipe=recipe)
    assert f"stage={stage} with backend.pp=2: a rollout generates token by token" in found
    assert "use backend.pp=1 (fsdp2 with backend.tp" in found


def test_ddp_and_deepspeed_name_the_backend_that_has_pp():
    for backend in ("ddp", "zero3"):
        with pytest.raises(ConfigError, match=r"backend.pp is a field of the fsdp2 backend \(backend=fsdp2/fsdp2_tp\)"):
            compose_config(["recipe=sft_tiny", f"backend={backend}", "backend.pp=2"])


def arch(layers=4, tied=False, **extra):
    return AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_key_value_heads=2, num_hidden_layers=layers, tie_word_embeddings=tied, **extra)


def pp_backend(**fields):
    return SimpleNamespace(**{"name": "fsdp2", "dp_replicate": 1, "dp_shard": -1, "tp": 1, "compile": False,
                              "cpu_offload": False, "pp": 2, "pp_schedule": "1f1b", "pp_virtual_stages": 1, **fields})


def test_model_checks_blocks_and_experts():
    check = model_check
    assert check(pp_backend(), 2, arch()) == []
    [message] = check(pp_backend(pp_schedule="interleaved_1f1b", pp_virtual_stages=3), 2, arch(layers=4))
    assert "4 decoder blocks, fewer than backend.pp=2 × backend.pp_virtual_stages=3 = 6 stages" in message
    assert check(pp_backend(), 2, arch(tied=True)) == []  # a copy on the first and the last stage, grads summed
    [tied] = check(pp_backend(pp_schedule="zbv", pp_virtual_stages=2, reshard_after_forward=False), 2, arch(tied=True))
    assert "zbv's V puts the first and the last stage (both copies) on pp rank 0" in tied and "backend.pp_schedule=zb" \
        in tied
    both = check(pp_backend(tp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=4), 32, arch(layers=4))
    assert "fewer than backend.pp=2 × backend.pp_virtual_stages=4" in both[0]  # the pipeline's and TP's checks
    assert "backend.tp=4 must divide the model's num_key_value_heads=2" in both[1] and "backend.pp=2 × " in both[1]
    moe = AutoConfig.for_model("mixtral", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=4, num_local_experts=4)
    assert any("mixture of experts" in p for p in check(pp_backend(), 2, moe))


# ---- the planner's pipeline lines -----------------------------------------------------------------------------------

def test_bubble_and_in_flight_formulas():
    from llmtrain.plan.pp import bubble_fraction, in_flight

    assert bubble_fraction(2, 2) == 1 / 3 and bubble_fraction(4, 8) == 3 / 11 and bubble_fraction(2, 4, 2) == 1 / 9
    assert [in_flight("gpipe", 4, r, 8, 1) for r in range(4)] == [8] * 4
    assert [in_flight("1f1b", 4, r, 8, 1) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("interleaved_1f1b", 2, r, 4, 2) for r in range(2)] == [5, 3]
    # zb, zbv: planned at their bound, every chunk of the step (torch's split backward holds them past the I pass)
    assert [in_flight("zb", 2, r, 4, 1) for r in range(2)] == [4, 4] and in_flight("zbv", 4, 0, 2, 2) == 4


def test_p2p_sends_per_rank_and_the_busiest_ranks_figure():
    from llmtrain.plan.pp import p2p_sends, pipeline_p2p

    assert p2p_sends(2, 1, 4) == [4, 4]  # stage 0 sends forward, stage 1 backward, once per micro-batch
    assert p2p_sends(4, 1, 8) == [8, 16, 16, 8]  # the middle stages send both ways
    assert p2p_sends(2, 2, 4) == [12, 12]  # rank 0: stage 0 (forward) + stage 2 (both); rank 1: stage 1 + stage 3
    assert p2p_sends(2, 2, 4, v_shape=True) == [8, 8]  # the V: rank 0 stages 0, 3; rank 1 stages 1, 2 (1 -> 2 local)
    assert p2p_sends(4, 2, 8, v_shape=True) == [16, 32, 32, 16]
    [p2p] = pipeline_p2p(pp_backend(pp=4), rows=2, accum=8, seq=16, hidden=32, precision="fp32")
    assert (p2p.kind, p2p.payload, p2p.times, p2p.wire) == ("p2p", 2 * 16 * 32 * 4, 16, 16 * 2 * 16 * 32 * 4)
    assert pipeline_p2p(pp_backend(pp=1), rows=2, accum=8, seq=16, hidden=32, precision="bf16") == []


def test_plan_prints_each_pp_ranks_stages():
    from llmtrain.plan.report import plan_text

    text = plan_text(compose_config(["recipe=sft_tiny", "model.from_config.num_hidden_layers=4", *PP2,
                                     "trainer.grad_accum_steps=4", "plan.world_size=4"]))
    assert "pipeline: pp 2 × v 1 = 2 stages, 1f1b, M = 4 micro-batches" in text
    assert "bubble (P−1)/(M+P−1) = 20.0%" in text
    assert "pp rank 0: stage 0: embed + blocks 0-1:" in text and "pp rank 1: stage 1: blocks 2-3 + norm + head:" in text
    assert "/dp 2)" in text
    zbv = plan_text(compose_config(["recipe=sft_tiny", "model.from_config.num_hidden_layers=4", *PP2,
                                    "trainer.grad_accum_steps=4", "plan.world_size=2", "backend.pp_schedule=zbv",
                                    "backend.pp_virtual_stages=2", "backend.reshard_after_forward=false"]))
    assert "bubble ≈ 0 in theory (zero-bubble" in zbv and "at most interleaved 1F1B's (P−1)/(v·M+P−1) = 11.1%" in zbv
    assert "pp rank 0: stage 0: embed + block 0; stage 3: block 3 + norm + head:" in zbv


def test_a_family_without_model_layers_is_refused():
    gpt2 = AutoConfig.for_model("gpt2", n_embd=32, n_head=4, n_layer=4, tie_word_embeddings=False)
    [message] = backend_model_problems(pp_backend(), 2, lambda: gpt2)
    assert "gpt2 does not name its blocks model.layers" in message and "use backend.pp=1" in message
