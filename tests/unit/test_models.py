"""Model and tokenizer loading: pad tokens the standard way, embedding resize, switches reach the model."""

import json
import shutil

import pytest
import torch

from llmtrain.models.load import build_model, load_tokenizer
from tests.helpers import TOKENIZER_DIR

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


def tiny(tokenizer, **kwargs):
    options = dict(name_or_path=None, from_config=TINY, config_path=None, tokenizer=tokenizer,
                   attn_implementation="sdpa", dropout=0.0, activation_checkpointing=False,
                   trust_remote_code=False)
    options.update(kwargs)
    return build_model(**options)


def test_tokenizer_without_pad_uses_eos():
    tokenizer = load_tokenizer(str(TOKENIZER_DIR), trust_remote_code=False)
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>" and len(tokenizer) == 263


def test_tokenizer_without_pad_or_eos_gets_a_new_pad_and_the_embeddings_grow(tmp_path):
    shutil.copytree(TOKENIZER_DIR, tmp_path / "tok")
    config_file = tmp_path / "tok" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token"] = None
    config_file.write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(tmp_path / "tok"), trust_remote_code=False)
    assert tokenizer.eos_token is None and tokenizer.pad_token == "<pad>" and len(tokenizer) == 264
    model = tiny(tokenizer, from_config={**TINY, "vocab_size": 263})
    assert model.get_input_embeddings().num_embeddings == 264
    assert model.get_output_embeddings().weight.shape[0] == 264
    assert model.config.pad_token_id == tokenizer.pad_token_id == 263


def test_vocab_defaults_to_the_tokenizer_and_switches_reach_the_model():
    tokenizer = load_tokenizer(str(TOKENIZER_DIR), trust_remote_code=False)
    model = tiny(tokenizer, dropout=0.25, activation_checkpointing=True)
    assert model.config.vocab_size == 263 and model.config.attention_dropout == 0.25
    assert model.is_activation_checkpointing and model.config.use_cache is False
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("installed, device, precision, dropout, expected", [
    ({"flash_attn", "triton"}, "cuda", "bf16", 0.0, "flash_attention_2"),
    ({"flash_attn", "triton"}, "cuda", "fp32", 0.0, "flex_segments"),  # flash kernels reject fp32
    ({"triton"}, "cuda", "bf16", 0.0, "flex_segments"),  # no flash-attn: one FlexAttention kernel per layer
    ({"triton"}, "cuda", "bf16", 0.1, "sdpa_segments"),  # FlexAttention has no dropout
    (set(), "cuda", "bf16", 0.0, "sdpa_segments"),  # no Triton, no compiled FlexAttention
    ({"flash_attn", "triton"}, "cpu", "bf16", 0.0, "sdpa_segments"),  # eager FlexAttention is slow, has no backward
])
def test_auto_attention(monkeypatch, installed, device, precision, dropout, expected):
    """flash-attention where installed for 16-bit compute, else FlexAttention on a GPU; sdpa per sample on the CPU."""
    import importlib.util

    from llmtrain.models.load import resolve_attn_implementation

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if name in installed else None)
                        if name in ("flash_attn", "triton") else real_find_spec(name, *a))
    assert resolve_attn_implementation("auto", torch.device(device), precision, dropout) == expected
    assert resolve_attn_implementation("eager", torch.device(device), "fp32") == "eager"


def test_flex_attention_is_refused_on_the_cpu():
    from llmtrain.config import ConfigError
    from llmtrain.models.load import resolve_attn_implementation

    with pytest.raises(ConfigError, match="no backward on the CPU"):
        resolve_attn_implementation("flex_segments", torch.device("cpu"), "fp32")
    assert resolve_attn_implementation("flex_segments", torch.device("cuda", 0), "fp32") == "flex_segments"
