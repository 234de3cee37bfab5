"""Every shipped yaml composes and validates; bad values fail with the field named."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llmtrain.compose import available_recipes, compose_config, conf_dir, recipes_dir
from llmtrain.config import ConfigError
from llmtrain.models.load import model_config
from llmtrain.validation import validate


def compose_ok(*overrides: str, world_size: int = 1):
    cfg = compose_config(list(overrides))
    validate(cfg, world_size=world_size)
    return cfg


def recipe_world_size(recipe: str) -> int:
    """The processes a recipe is written for: its header's `--nproc_per_node N` (the 7B/8B recipes: 8), else 1."""
    found = re.search(r"--nproc_per_node (\d+)", (recipes_dir() / f"{recipe}.yaml").read_text())
    return int(found.group(1)) if found else 1


def starts_from_a_base(recipe: str) -> bool:
    """The recipe, or one it builds on (its defaults list), names a trained base (${base:...})."""
    text = (recipes_dir() / f"{recipe}.yaml").read_text()
    parents = [d for d in (OmegaConf.create(text).get("defaults") or [])
               if isinstance(d, str) and (recipes_dir() / f"{d}.yaml").is_file()]
    return "${base:" in text or any(starts_from_a_base(parent) for parent in parents)


def recipe_params() -> list:
    """Every recipe; one that starts from a trained base marked uses_base (tests/conftest.py runs those last among
    the unit tests, by when CI's background build has the base ready)."""
    return [pytest.param(r, marks=pytest.mark.uses_base) if starts_from_a_base(r) else r for r in available_recipes()]


@pytest.mark.parametrize("recipe", recipe_params())
def test_every_recipe_composes_and_validates(recipe):
    cfg = compose_ok(f"recipe={recipe}", world_size=recipe_world_size(recipe))
    assert cfg.recipe == recipe and cfg.output_dir == f"runs/{recipe}"
    m = cfg.model
    arch = model_config(m.name_or_path, m.from_config, m.config_path, m.trust_remote_code)
    assert arch.num_hidden_layers >= 1


def group_options():
    root = conf_dir()
    return [(group.name, option.stem) for group in sorted(root.iterdir()) if group.is_dir()
            for option in sorted(group.glob("*.yaml"))]


def leaves(node, prefix: str = "") -> dict:
    """{dotted key: plain value} of a yaml's leaves (lists whole), its defaults list left out."""
    found = {}
    for key, value in node.items():
        if key == "defaults" and not prefix:
            continue
        if isinstance(value, dict) or OmegaConf.is_dict(value):
            found.update(leaves(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return found


def option_leaves(group: str, option: str) -> dict:
    """What conf/GROUP/OPTION.yaml sets, as dotted keys of the whole config (a `# @package _global_` file's keys
    are already global); values with an interpolation (${asset:...}) left out."""
    path = conf_dir() / group / f"{option}.yaml"
    prefix = "" if "@package _global_" in path.read_text() else f"{group}."
    return {prefix + key: value for key, value in leaves(OmegaConf.load(path)).items() if "${" not in str(value)}


@pytest.mark.parametrize("group,option", group_options())
def test_every_group_option_composes(group, option):
    pairs = ["data.packing=false"]
    rl = ["data=reverse", "ppo.reward.function=llmtrain.rewards.reversal:score", *pairs]
    extra = {"stage": {"pretrain": ["data=grammar"], "sft": ["data=reverse"],
                       "reward": ["data=reverse_prefs", *pairs], "dpo": ["data=reverse_prefs_easy", *pairs],
                       "simpo": ["data=reverse_prefs_easy", *pairs], "orpo": ["data=reverse_prefs_easy", *pairs],
                       "kto": ["data=reverse_prefs_easy", *pairs], "ppo": rl, "grpo": rl},
             "data": {"reverse": ["stage=sft"], "alpaca": ["stage=sft"], "reverse_prefs": ["stage=reward", *pairs],
                      "reverse_prefs_easy": ["stage=dpo", *pairs], "hh_rlhf": ["stage=reward", *pairs],
                      "ultrafeedback_prompts": ["stage=ppo", *rl[1:]], "lookup_traces": ["stage=sft"],
                      "lookup": ["stage=grpo", "ppo.reward.function=llmtrain.tasks.lookup:score", *pairs]}}
    overrides = extra.get(group, {}).get(option, [])
    world_size = {("backend", "fsdp2_tp"): 2}.get((group, option), 1)  # tp=2 needs two ranks
    cfg = compose_ok("recipe=pretrain_tiny", f"{group}={option}", *overrides, world_size=world_size)
    # every value the option's yaml sets is in the composed config, save those the recipe or the command line set
    # after it (pretrain_tiny's data.packing, trainer.*, optim.lr, ...; a pair's data.packing=false)
    later = leaves(OmegaConf.load(recipes_dir() / "pretrain_tiny.yaml")).keys() | {o.split("=")[0] for o in overrides}
    expected = {key: value for key, value in option_leaves(group, option).items()
                if not any(key == k or key.startswith(f"{k}.") for k in later)}
    assert expected, (group, option)  # the check below compares something
    for key, value in expected.items():
        got = OmegaConf.select(cfg, key)
        assert (OmegaConf.to_container(got) if OmegaConf.is_config(got) else got) == value, (key, got, value)


def test_cli_group_choice_beats_the_recipe():
    assert compose_ok("recipe=sft_tiny", "data=grammar", "stage=pretrain").data.format == "text"


def test_command_line_values_reach_the_config():
    cfg = compose_ok("recipe=sft_tiny", "trainer.max_steps=7", "optim.lr=0.5", "optim.schedule=linear")
    assert (cfg.trainer.max_steps, cfg.optim.lr, cfg.optim.schedule) == (7, 0.5, "linear")


@pytest.mark.parametrize("override,needle", [
    ("trainer.bogus=1", "trainer.bogus"),
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("optim.schedule=triangle", "optim.schedule"),
    ("precision=fp8", "precision"),
    ("data.format=csv", "data.format"),
    ("data.overlong=wrap", "data.overlong"),
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size"),
    ("optim.lr=-1", "optim.lr"),
    ("data.format=text", "data.format"),  # sft stage with plain text
    ("data.overlong=chunk", "data.overlong=chunk"),  # sft_tiny's prompt_response samples cannot be split
])
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        compose_ok("recipe=sft_tiny", override)


def test_flex_attention_refuses_dropout():
    with pytest.raises(ConfigError, match=r"model\.attn_implementation=flex_segments has no attention dropout"):
        compose_ok("recipe=sft_tiny", "model.attn_implementation=flex_segments", "model.dropout=0.1")
    compose_ok("recipe=sft_tiny", "model.attn_implementation=flex_segments", "model.dropout=0")


def test_global_batch_arithmetic_is_shown():
    cfg = compose_config(["recipe=sft_tiny", "trainer.global_batch_size=100", "trainer.micro_batch_size=4",
                          "trainer.grad_accum_steps=2"])
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size=4)
    assert "trainer.global_batch_size=100" in str(error.value) and "4 × trainer.grad_accum_steps 2 × dp 4 = 32" \
        in str(error.value)
    validate(compose_config(["recipe=sft_tiny", "trainer.global_batch_size=32", "trainer.micro_batch_size=4",
                             "trainer.grad_accum_steps=2"]), world_size=4)


def test_all_problems_reported_together():
    cfg = compose_config(["recipe=sft_tiny", "trainer.max_steps=0", "optim.min_lr_ratio=2"])
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size=1)
    assert "trainer.max_steps" in str(error.value) and "optim.min_lr_ratio" in str(error.value)


def test_unknown_from_config_field_is_an_error():
    cfg = compose_ok("recipe=sft_tiny", "+model.from_config.hiden_size=64")
    m = cfg.model
    with pytest.raises(ConfigError, match="hiden_size"):
        model_config(m.name_or_path, m.from_config, m.config_path, m.trust_remote_code)


def test_model_source_must_be_exactly_one():
    with pytest.raises(ConfigError, match="model.name_or_path"):
        compose_ok("recipe=sft_tiny", "model.name_or_path=/some/dir")


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ConfigError, match="sft_tiny"):
        compose_config(["recipe=nope"])
    with pytest.raises(ConfigError, match="recipe=NAME"):
        compose_config(["trainer.max_steps=3"])


def test_recipe_from_a_path(tmp_path: Path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - config\n  - _self_\ntrainer:\n  max_steps: 3\n")
    cfg = compose_ok(f"recipe={recipe}")
    assert cfg.trainer.max_steps == 3 and cfg.recipe == "mine"


@pytest.mark.parametrize("override, message", [
    ("model.compile=true", "config: model.compile is not a field of model; model has: name_or_path,"),
    ("trainer.max_step=3", "did you mean trainer.max_steps?"),
    ("beta=1", "did you mean dpo.beta or simpo.beta or orpo.beta or kto.beta?"),
    ("backend.zero_stage=2", "backend.zero_stage is a field of the deepspeed backend (backend=deepspeed/zero0"),
    ("backend.pp=2", "backend.pp is a field of the fsdp2 backend (backend=fsdp2/fsdp2_tp)"),
    ("backend.cp=2", "backend.cp is a field of the deepspeed backend (backend=deepspeed/zero0"),
])
def test_an_unknown_or_misplaced_key_gets_the_projects_message(override, message):
    with pytest.raises(ConfigError) as error:
        compose_config(["recipe=sft_tiny", override])
    assert message in str(error.value) and "not in struct" not in str(error.value), str(error.value)
