"""What model families need before they load (models/load.py, models/attention.py, models/moe.py): the attention a
family's transformers class supports, a pad id inside the vocabulary, sliding windows in sdpa_segments, and the MoE
router loss as transformers computes it, with padding (and packed rows' padding tails) left out."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmtrain.config import ConfigError
from llmtrain.data.collate import collate
from llmtrain.models.attention import SEGMENT_ATTENTION, register_segment_attention
from llmtrain.models.load import attention_for_family, load_tokenizer, model_config
from llmtrain.models.moe import router_forward, router_of
from llmtrain.stages.base import Updater
from tests.helpers import TOKENIZER_DIR

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=100)


def config(model_type: str, **fields):
    return AutoConfig.for_model(model_type, **{**TINY, **fields})


def test_a_family_without_sdpa_runs_eager_and_an_explicit_choice_it_lacks_is_an_error():
    assert attention_for_family(SEGMENT_ATTENTION, "auto", [config("gemma2")]) == "eager"
    dense = [config("gemma3_text"), config("llama")]
    assert attention_for_family(SEGMENT_ATTENTION, "auto", dense) == SEGMENT_ATTENTION
    assert attention_for_family("sdpa", "auto", [config("llama"), config("gemma2")]) == "eager"
    with pytest.raises(ConfigError, match=r"model.attn_implementation=sdpa: Gemma2ForCausalLM \(gemma2\) does not "
                                          r"support it in transformers; use one of: auto, eager, flash_attention_2"):
        attention_for_family("sdpa", "sdpa", [config("gemma2")])
    assert attention_for_family("eager", "eager", [config("gemma2")]) == "eager"



def test_an_explicit_attention_the_family_lacks_is_refused_by_validation_before_any_weights(tmp_path, monkeypatch):
    """Validation (every rank, before the process group) reads the architecture config alone, from
    model.from_config or a local checkpoint's config.json, and names the field and the fix; nothing is built."""
    from llmtrain.compose import compose_config
    from llmtrain.validation import validate

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built during validation")

    for method in ("from_config", "from_pretrained"):
        monkeypatch.setattr(AutoModelForCausalLM, method, no_model)
    gemma2 = "{model_type:gemma2,hidden_size:32,intermediate_size:64,num_hidden_layers:2,num_attention_heads:4," \
             "num_key_value_heads:2,head_dim:8}"
    fix = r"model.attn_implementation=sdpa: Gemma2ForCausalLM \(gemma2\) does not support it in transformers; " \
          r"use one of: auto, eager, flash_attention_2"
    sizes = ["recipe=sft_tiny", "model.name_or_path=null", f"model.tokenizer={TOKENIZER_DIR}"]
    with pytest.raises(ConfigError, match=fix):
        validate(compose_config([*sizes, f"model.from_config={gemma2}", "model.attn_implementation=sdpa"]), 1)
    checkpoint = tmp_path / "gemma2"
    config("gemma2").save_pretrained(checkpoint)
    local = ["recipe=sft_tiny", f"model.name_or_path={checkpoint}", "model.from_config=null"]
    with pytest.raises(ConfigError, match=fix):
        validate(compose_config([*local, "model.attn_implementation=sdpa"]), 1)
    validate(compose_config([*local, "model.attn_implementation=eager"]), 1)
    validate(compose_config([*local, "model.attn_implementation=auto"]), 1)  # auto: eager, said in the log
    validate(compose_config([*sizes, "model.from_config={model_type:llama,hidden_size:32,num_attention_heads:4}",
                             "model.attn_implementation=sdpa"]), 1)

def test_a_default_pad_id_outside_the_vocabulary_becomes_the_tokenizers_and_a_given_one_is_an_error(tmp_path):
    fields = {"model_type": "phi3", **{k: v for k, v in TINY.items() if k != "head_dim"}}
    assert AutoConfig.for_model("phi3").pad_token_id == 32000
    assert model_config(None, fields, None, False, pad_token_id=7).pad_token_id == 7
    assert model_config(None, fields, None, False).pad_token_id is None  # the planner's copy: no tokenizer
    with pytest.raises(ConfigError, match=r"model.from_config.pad_token_id: pad_token_id=500 lies outside "
                                          r"vocab_size=100"):
        model_config(None, {**fields, "pad_token_id": 500}, None, False)
    checkpoint = tmp_path / "ckpt"
    config("llama").save_pretrained(checkpoint)
    data = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**data, "pad_token_id": 100}))
    with pytest.raises(ConfigError, match=r"ckpt: its config.json: pad_token_id=100 lies outside vocab_size=100 .*"
                                          r"set it to the tokenizer's pad id or null"):
        model_config(str(checkpoint), None, None, False)


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_sdpa_segments_keeps_sliding_windows(model_type):
    """Window 4 < the lengths: sdpa_segments (whole rows and packed samples) gives transformers' sdpa logits."""
    register_segment_attention()
    torch.manual_seed(0)
    cfg = config(model_type, sliding_window=4)
    reference = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_config(cfg, attn_implementation=SEGMENT_ATTENTION).eval()
    ours.load_state_dict(reference.state_dict())
    a, b = torch.randint(0, 100, (1, 12)), torch.randint(0, 100, (1, 7))
    with torch.no_grad():
        expected_a, expected_b = reference(input_ids=a).logits, reference(input_ids=b).logits
        whole = ours(input_ids=a).logits
        packed = ours(input_ids=torch.cat([a, b], 1), position_ids=torch.cat([torch.arange(12), torch.arange(7)])[None],
                      segment_lengths=((12, 7),)).logits
    torch.testing.assert_close(whole, expected_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, :12], expected_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, 12:], expected_b, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def moe():
    register_segment_attention()
    tokenizer = load_tokenizer(str(TOKENIZER_DIR), False)
    torch.manual_seed(0)
    cfg = config("mixtral", num_local_experts=4, num_experts_per_tok=2, vocab_size=len(tokenizer))
    return tokenizer, AutoModelForCausalLM.from_config(cfg, attn_implementation=SEGMENT_ATTENTION)


def test_no_router_loss_where_transformers_trains_none():
    """Llama-4's config carries router_aux_loss_coef, but transformers never adds a load-balancing loss for its sigmoid
    top-1 router: llmtrain treats it as transformers does (no term), and keeps Mixtral's under peft too."""
    from peft import LoraConfig, get_peft_model

    llama4 = config("llama4_text", num_local_experts=4, intermediate_size_mlp=64, vocab_size=263)
    assert llama4.router_aux_loss_coef and router_of(AutoModelForCausalLM.from_config(llama4)) is None
    mixtral = AutoModelForCausalLM.from_config(config("mixtral", num_local_experts=4, vocab_size=263))
    adapted = get_peft_model(mixtral, LoraConfig(r=2, target_modules=["q_proj"]))
    assert router_of(adapted) == router_of(mixtral) and router_of(mixtral).num_experts == 4
    assert router_of(SimpleNamespace(config=llama4)) is None  # a bare config (the pre-load checks)
    assert router_of(SimpleNamespace(config=mixtral.config)) == router_of(mixtral)


def test_router_loss_is_transformers_with_padding_and_packed_tails_left_out(moe):
    tokenizer, model = moe
    assert router_of(model).num_experts == 4 and router_of(model).top_k == 2 and router_of(model).coef == 0.001
    assert router_of(torch.nn.Linear(2, 2)) is None
    rows = [list(range(5, 17)), list(range(20, 27))]
    examples = [{"input_ids": r, "labels": r} for r in rows]
    padded = collate(examples, tokenizer.pad_token_id)  # (2, 12): row 2 has 5 padding positions
    with torch.no_grad():
        expected = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, output_router_logits=True)
        out, term, stats = router_forward(model, padded.for_attention(SEGMENT_ATTENTION))
        assert expected.aux_loss is not None and term == pytest.approx(0.001 * expected.aux_loss.item(), rel=1e-6)
        assert stats[0] == pytest.approx(expected.aux_loss.item(), rel=1e-6) and 1 <= stats[1] <= 4
        # rows 1 and 2 packed into one row, and the first 4 tokens of row 2 with a padding tail of 15: the same real
        # tokens, the same hidden states (samples apart), as three padded rows under transformers' own loss
        three = collate([*examples, {"input_ids": rows[1][:4], "labels": rows[1][:4]}], tokenizer.pad_token_id)
        expected = model(input_ids=three.input_ids, attention_mask=three.attention_mask, output_router_logits=True)
        packed = collate([{"input_ids": rows[0] + rows[1], "labels": rows[0] + rows[1],
                           "position_ids": list(range(12)) + list(range(7)), "seq_lens": [12, 7]},
                          {"input_ids": rows[1][:4], "labels": rows[1][:4]}], tokenizer.pad_token_id)
        _, _, packed_stats = router_forward(model, packed.for_attention(SEGMENT_ATTENTION))
    assert packed.token_mask().sum() == 23
    assert packed_stats[0] == pytest.approx(expected.aux_loss.item(), rel=1e-5)


class OneRankEngine:
    """What Updater calls on an engine: a plain model, one process, `dp_size` as if there were more ranks."""
    dp_group = None
    skips_nonfinite_grads = False

    def __init__(self, model, dp_size: int = 1):
        self.module, self.dp_size, self.ctx = model, dp_size, SimpleNamespace(device=torch.device("cpu"))

    def no_sync(self, is_last_micro_batch):
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def current_lr(self):
        return 0.0

    def clip_or_fused_step(self):
        return torch.zeros(())

    def step(self):
        pass


def test_the_mean_term_is_averaged_over_micro_batches_and_ranks():
    """loss = Σ loss sums / count + mean over the step's micro-batches (× ranks) of the mean term; its gradient too."""
    weight = torch.nn.Parameter(torch.tensor(2.0))
    model = torch.nn.Module()
    model.weight = weight
    terms = iter([1.0, 3.0])

    def micro_loss(module, batch):
        return module.weight * batch, torch.zeros(0), module.weight * next(terms)

    result = Updater(torch.device("cpu"), skip_nonfinite=False).update(OneRankEngine(model, dp_size=2), [4.0, 6.0],
                                                                         micro_loss, 10)
    assert result.loss == pytest.approx(2 * (4 + 6) / 10 + 2 * (1 + 3) / (2 * 2))
    assert weight.grad.item() == pytest.approx((4 + 6) / 10 + (1 + 3) / 4)


@pytest.mark.parametrize("stage_name", ["simpo", "orpo", "rm"])
def test_reference_free_pair_stages_add_the_router_loss(stage_name):
    """SimPO, ORPO and the reward model on an MoE model: the step's loss is the pair loss plus coef × the routers' aux
    loss, and aux_loss / expert_load_max are logged; as SFT, DPO and the GRPO actor (issue 19). The reward model's
    sequence classifier drops the router logits from its output: they are taken from its backbone's."""
    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.backends.ddp import DDPBackend
    from llmtrain.distributed import DistContext
    from llmtrain.losses.lm import IGNORE_INDEX
    from llmtrain.losses.pairwise import pairwise_loss_sum
    from llmtrain.roles import ModelOptions, build_engines
    from llmtrain.stages.base import ModelSource
    from llmtrain.stages.orpo import ORPOStage
    from llmtrain.stages.reward import RewardStage
    from llmtrain.stages.simpo import SimPOStage

    tokenizer = load_tokenizer(str(TOKENIZER_DIR), False)
    fields = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2,
              "router_aux_loss_coef": 0.5}
    source = ModelSource(None, fields)
    stage = {"simpo": lambda: SimPOStage(source, tokenizer.pad_token_id, beta=2.0, gamma=0.5),
             "orpo": lambda: ORPOStage(source, tokenizer.pad_token_id, beta=0.1),
             "rm": lambda: RewardStage(source, tokenizer.pad_token_id)}[stage_name]()
    optim = OptimizerSpec(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                          min_lr_ratio=1.0, max_grad_norm=0.0, max_steps=1)
    engines = build_engines(stage.roles, DDPBackend(DistContext(0, 0, 1, torch.device("cpu")), "fp32"), tokenizer,
                            ModelOptions("sdpa", 0.0, False, 0), 0, optim)
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(2):
        prompt, chosen, rejected = (torch.randint(3, 200, (k,), generator=g).tolist() for k in (5, 4, 6))
        rows.append({f"{side}_{key}": value for side, response in (("chosen", chosen), ("rejected", rejected))
                     for key, value in (("input_ids", prompt + response),
                                        ("labels", [IGNORE_INDEX] * len(prompt) + response))})
    batch = stage.collate(rows)
    engine = next(iter(engines.values()))
    with torch.no_grad():
        if stage_name == "rm":
            pair_loss = pairwise_loss_sum(*stage.scores(engine, engine.module, batch), batch.margin, 0.0).item() / 2
        else:
            plain = stage.logps(engine.module, batch)
            terms = stage.terms(plain) if stage_name == "simpo" else stage.terms(*plain[1:])
            pair_loss = terms.losses.mean().item()
    metrics = stage.train_step([batch], engines, Updater(torch.device("cpu"), skip_nonfinite=False))
    assert 1.5 < metrics["aux_loss"] < 4 and 1 <= metrics["expert_load_max"] <= 4
    if stage_name != "orpo":  # ORPO's loss adds the chosen NLL per token
        assert metrics["loss"] == pytest.approx(pair_loss + 0.5 * metrics["aux_loss"], rel=1e-5)


def test_packed_rows_that_would_lose_a_sliding_window_are_refused():
    """Packed rows reach eager/sdpa/flex as one mask for every layer: a sliding layer (Gemma-2: eager only) would see
    its whole sample. Refused, naming the fix, where a sample can outgrow the window; sdpa_segments and flash keep
    windows; families without sliding layers (Qwen2: layer_types all full) and short samples pass."""
    from llmtrain.models.load import packed_window_problems, sliding_window

    gemma2, mistral, qwen2 = config("gemma2", sliding_window=8), config("mistral", sliding_window=8), config("qwen2")
    assert (sliding_window(gemma2), sliding_window(mistral), sliding_window(qwen2)) == (8, 8, None)
    problems = packed_window_problems("eager", [gemma2, qwen2], max_seq_len=64)
    assert len(problems) == 1 and "gemma2's sliding window of 8 tokens would be lost" in problems[0]
    assert "sdpa_segments (it keeps the window), flash_attention_2 on a GPU, or data.packing=false" in problems[0]
    assert packed_window_problems("flex_segments", [mistral], 64) and packed_window_problems("sdpa", [mistral], 64)
    assert packed_window_problems("sdpa_segments", [gemma2, mistral], 64) == []
    assert packed_window_problems("eager", [gemma2], max_seq_len=8) == []


def test_an_moe_critic_adds_its_router_loss():
    """PPO's critic on an MoE model (a sequence classifier: its output drops the router logits, taken from the
    backbone): the value loss comes with coef × the routers' aux loss and (aux, busiest expert's load)."""
    from llmtrain.compose import compose_config
    from llmtrain.models.load import build_model
    from llmtrain.stages.ppo.experience import Experience
    from llmtrain.stages.registry import build_stage

    tokenizer = load_tokenizer(str(TOKENIZER_DIR), False)
    stage = build_stage(compose_config(["recipe=ppo_tiny"]), tokenizer, "sdpa")
    fields = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2,
              "router_aux_loss_coef": 0.5}
    critic = build_model(name_or_path=None, from_config=fields, config_path=None, tokenizer=tokenizer,
                         attn_implementation="sdpa", dropout=0.0, activation_checkpointing=False,
                         trust_remote_code=False, head="scalar", seed=0)
    sequences = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    zeros = torch.zeros(2, 4)
    mb = Experience(sequences, torch.ones_like(sequences), torch.ones(2, 4, dtype=torch.bool), zeros, zeros, zeros,
                    zeros, zeros, torch.ones(2, 4), torch.zeros(2), zeros, torch.ones(2, dtype=torch.bool))
    loss, stats, term = stage._value_loss(critic, mb, model=critic)
    assert 1.5 < stats[1] < 4 and 1 <= stats[2] <= 4
    assert term.item() == pytest.approx(0.5 * stats[1].item(), rel=1e-6)
    term.backward()
    gates = [p.grad for n, p in critic.named_parameters() if "gate.weight" in n]
    assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)
