"""Stop tokens derived once (eos, the checkpoint's generation_config.json, the chat template's end of turn) and
rollouts that sample from exactly the distribution the loss scores, whatever the checkpoint's sampling defaults."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from llmtrain.models.stop_tokens import derive_stop_tokens, end_of_turn_id
from llmtrain.stages.ppo.rollout import (
    SamplingSettings,
    checkpoint_overrides,
    generation_config,
    neutral_generation_config,
)
from tests.helpers import TOKENIZER_DIR


def test_chat_data_adds_the_templates_end_of_turn(tokenizer):
    assert tokenizer.convert_ids_to_tokens([257, 262]) == ["</s>", "<|end|>"]
    assert end_of_turn_id(tokenizer) == 262
    chat = derive_stop_tokens(tokenizer, None, chat=True)
    assert (chat.ids, chat.names, chat.end_of_turn) == ((257, 262), ("eos", "end of turn"), 262)
    assert chat.describe(tokenizer) == "</s> (257, eos), <|end|> (262, end of turn)"
    assert derive_stop_tokens(tokenizer, None, chat=False).ids == (257,)


def test_the_checkpoints_generation_config_adds_its_eos_list(tokenizer, tmp_path):
    GenerationConfig(eos_token_id=[257, 260], temperature=0.6, do_sample=True).save_pretrained(tmp_path)
    stop = derive_stop_tokens(tokenizer, str(tmp_path), chat=True)
    assert stop.ids == (257, 262, 260) and stop.names == ("eos", "end of turn", "generation_config")


def test_a_template_without_a_special_end_of_turn_has_none(tokenizer):
    plain = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_id(plain) is None
    plain.chat_template = None
    assert end_of_turn_id(plain) is None


@pytest.mark.parametrize("template,end_of_turn", [
    ("gemma3", "<end_of_turn>"), ("gemma", "<end_of_turn>"), ("phi3", "<|end|>"), ("qwen3", "<|im_end|>"),
    ("qwen2_5", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("deepseekv3", "<｜end▁of▁sentence｜>"),
    ("gptoss", "<|return|>"), ("glm4moe", None)])  # GLM prints no end of turn: the next role's token ends the reply
def test_trls_own_templates_give_their_end_of_turn(template, end_of_turn):
    """TRL's shipped chat templates on the bundled tokenizer, each template's markers added as special tokens."""
    import importlib.resources
    import re

    text = (importlib.resources.files("trl") / "chat_templates" / f"{template}.jinja").read_text()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    markers = sorted(set(re.findall(r"<[|｜][^<>{}'\" ]{1,40}?[|｜]>|<(?:start|end)_of_turn>", text)))
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    tokenizer.chat_template = text
    found = end_of_turn_id(tokenizer)
    assert (found and tokenizer.convert_ids_to_tokens(found)) == end_of_turn


@pytest.fixture(scope="module")
def skewed_checkpoint(tmp_path_factory, tokenizer, tiny_llama):
    """A tiny Llama whose generation_config.json carries sampling defaults that change what generate() does."""
    directory = tmp_path_factory.mktemp("skewed")
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked logits: min_p 0.2 keeps 8 tokens, 73 % of the mass lies below it
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_k=3, top_p=0.5,
                                               repetition_penalty=5.0, no_repeat_ngram_size=1, min_p=0.2)
    model.save_pretrained(directory)
    return directory


def greedy_by_hand(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        next_id = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], 1)
    return ids


@torch.no_grad()
def test_neutral_config_samples_what_the_loss_scores(skewed_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(skewed_checkpoint).eval()
    assert checkpoint_overrides(model.generation_config) == {
        "do_sample": True, "temperature": 0.6, "top_k": 3, "top_p": 0.5, "repetition_penalty": 5.0,
        "no_repeat_ngram_size": 1, "min_p": 0.2}
    prompt = torch.tensor([[1, 40, 41, 42]])
    greedy = generation_config(SamplingSettings(max_new_tokens=12, temperature=0.0), pad_token_id=0, eos_ids=[257])
    expected = greedy_by_hand(model, prompt, 12)
    with neutral_generation_config(model):
        neutral = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy)
    assert torch.equal(neutral, expected)
    assert model.generation_config.repetition_penalty == 5.0  # put back after the context
    sampled = generation_config(SamplingSettings(max_new_tokens=1, temperature=0.7), pad_token_id=0, eos_ids=[257])

    def draws(neutral: bool) -> list[int]:
        out = []
        for seed in range(300):
            torch.manual_seed(seed)
            with neutral_generation_config(model) if neutral else torch.no_grad():
                out.append(int(model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                              generation_config=sampled)[0, -1]))
        return out

    probs = torch.softmax(model(input_ids=prompt).logits[0, -1] / 0.7, -1)  # (V,): what the loss scores
    min_p_kept = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    neutral, control = draws(True), draws(False)
    assert set(control) <= min_p_kept  # the control: left to transformers, the checkpoint's min_p applies
    assert set(neutral) - min_p_kept  # neutral: tokens below min_p are drawn too
    top = int(probs.argmax())
    assert abs(neutral.count(top) / len(neutral) - probs[top].item()) < 0.08, (neutral.count(top), probs[top].item())


def test_stop_tokens_of_a_run_are_logged(tokenizer, skewed_checkpoint, caplog):
    import logging

    from omegaconf import OmegaConf

    from llmtrain.stages.base import ModelSource
    from llmtrain.stages.ppo.build import stop_ids

    tokenizer.save_pretrained(skewed_checkpoint)
    (skewed_checkpoint / "generation_config.json").write_text(json.dumps(
        {**json.loads((skewed_checkpoint / "generation_config.json").read_text()), "eos_token_id": [257]}))
    cfg = OmegaConf.create({"data": {"format": "messages"}})
    with caplog.at_level(logging.INFO, logger="llmtrain.stages.ppo.build"):
        assert stop_ids(cfg, ModelSource(str(skewed_checkpoint)), tokenizer) == [257, 262]
    assert "stop tokens: </s> (257, eos), <|end|> (262, end of turn)" in caplog.text
    assert "repetition_penalty=5.0" in caplog.text and "no_repeat_ngram_size=1" in caplog.text
