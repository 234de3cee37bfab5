"""The command-line contract: `--help`, the tiny model groups, and `model.from_config` = model_type plus the fields
of that transformers config class (docs/guide/cli.md)."""

from __future__ import annotations

import pytest
import torch

from llmtrain.__main__ import main
from llmtrain.compose import available_recipes, compose_config, conf_dir
from llmtrain.config import ConfigError
from llmtrain.models.load import build_model, count_parameters, load_tokenizer, model_config
from llmtrain.validation import validate

TINY = ("tiny_llama", "tiny_qwen2", "tiny_mistral", "tiny_gpt2")


def arch(*overrides: str):
    cfg = compose_config(["recipe=sft_tiny", *overrides])
    validate(cfg, world_size=1)
    m = cfg.model
    return model_config(m.name_or_path, m.from_config, m.config_path, m.trust_remote_code)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_recipes_groups_options_and_where_the_fields_are(flag, capsys):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m llmtrain recipe=NAME")
    for recipe in available_recipes():
        assert f"  {recipe} " in out
    for group in (p for p in conf_dir().iterdir() if p.is_dir()):
        line = next(line for line in out.splitlines() if line.startswith(f"  {group.name} "))
        assert all(option.stem in line for option in group.glob("*.yaml")), line
    assert "docs/reference/config.md" in out and "docs/guide/cli.md" in out  # pages tests/unit/test_docs.py checks
    assert main(["recipe=sft_tiny", flag, "trainer.max_steps=3"]) == 0  # anywhere on the line


def test_from_config_takes_the_fields_of_its_class():
    config = arch("model=tiny_gpt2", "model.from_config.n_embd=64", "model.from_config.n_layer=1")
    assert (config.model_type, config.n_embd, config.n_layer, config.n_inner) == ("gpt2", 64, 1, 384)
    llama = arch("model.from_config.rms_norm_eps=1e-5")  # a field the group does not list
    assert llama.model_type == "llama" and llama.rms_norm_eps == 1e-5


@pytest.mark.parametrize("overrides", [
    ("model.from_config=null", "model.from_config.model_type=gpt2", "model.from_config.n_embd=64"),
    ("model.from_config={model_type: gpt2, n_embd: 64}",),
])
def test_from_config_can_be_replaced_whole(overrides):
    config = arch(*overrides)
    assert (config.model_type, config.n_embd, config.n_inner) == ("gpt2", 64, None)  # nothing of tiny_llama left


def test_switching_model_type_names_the_fields_carried_from_the_group():
    with pytest.raises(ConfigError) as error:
        arch("model.from_config.model_type=gpt2", "model.from_config.n_embd=64")
    message = str(error.value)
    assert "gpt2 configs (GPT2Config) have no field(s) intermediate_size, num_key_value_heads" in message
    assert "use model=tiny_gpt2" in message and "model.from_config=null model.from_config.model_type=gpt2" in message
    assert "hidden_size is GPT2Config's alias of n_embd and both are set: set only n_embd" in message


def test_switching_to_a_class_with_the_same_fields_keeps_them():
    config = arch("model.from_config.model_type=qwen2")
    assert (config.model_type, config.hidden_size, config.num_key_value_heads) == ("qwen2", 128, 2)


def test_a_misspelled_field_is_named():
    with pytest.raises(ConfigError, match="llama configs .LlamaConfig. have no field.s. hiden_size; check the spell"):
        arch("model.from_config.hiden_size=64")
    with pytest.raises(ConfigError, match="model.from_config.model_type='nope' is not a transformers model type"):
        arch("model.from_config.model_type=nope")


def test_the_cli_stops_with_the_message(tmp_path, capsys):
    code = main(["recipe=sft_tiny", "model.from_config.model_type=gpt2", "model.from_config.n_embd=64",
                 "dry_run=true", f"output_dir={tmp_path / 'run'}"])
    assert code == 2 and "use model=tiny_gpt2" in capsys.readouterr().err
    assert main(["recipe=sft_tiny", "model=tiny_gpt2", "model.from_config.n_embd=64", "dry_run=true",
                 f"output_dir={tmp_path / 'run'}"]) == 0


@pytest.mark.parametrize("group", TINY)
def test_tiny_model_groups_build_in_one_size_class(group):
    cfg = compose_config(["recipe=sft_tiny", f"model={group}"])
    validate(cfg, world_size=1)
    m = cfg.model
    tokenizer = load_tokenizer(m.tokenizer, False)
    model = build_model(name_or_path=m.name_or_path, from_config=m.from_config, config_path=m.config_path,
                        tokenizer=tokenizer, attn_implementation="sdpa", dropout=0.0, activation_checkpointing=False,
                        trust_remote_code=False)
    assert model.config.model_type == group.removeprefix("tiny_")
    assert 400_000 < count_parameters(model) < 600_000  # tiny_llama: 460k
    ids = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
