"""Model and tokenizer loading: pad tokens the standard way, embedding resize, switches reach the model."""

import json
import shutil

import torch

from llmtrain.models.load import build_model, load_tokenizer
from tests.conftest import TOKENIZER_DIR

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


def test_auto_attention_picks_flash_only_for_16_bit_compute(monkeypatch):
    """flash-attention kernels reject fp32: with flash-attn installed, precision=fp32 on a GPU gets sdpa."""
    import importlib.util

    import torch

    from llmtrain.models.attention import SEGMENT_ATTENTION
    from llmtrain.models.load import resolve_attn_implementation

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    cuda = torch.device("cuda", 0)
    assert resolve_attn_implementation("auto", cuda, "bf16") == "flash_attention_2"
    assert resolve_attn_implementation("auto", cuda, "fp32") == SEGMENT_ATTENTION
    assert resolve_attn_implementation("auto", torch.device("cpu"), "bf16") == SEGMENT_ATTENTION
    assert resolve_attn_implementation("eager", cuda, "fp32") == "eager"
