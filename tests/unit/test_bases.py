"""${base:...} without building anything: cache keys, naming a base, cycles, a build's environment.
(tests/e2e/test_bases.py builds bases: once under concurrency, reuse, failures, recursion, torchrun.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtrain import bases
from llmtrain.compose import compose_config, recipes_dir
from llmtrain.config import ConfigError
from tests.helpers import TINY_BASE, uses_base, write_recipe


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_entry_lives_in_the_cache_under_recipe_and_key(tmp_path, cache):
    entry = bases.base_entry(str(write_recipe(tmp_path / "tiny.yaml")), compose_config)
    assert entry.name == "tiny" and len(entry.key) == 12
    assert entry.dir == cache.resolve() / "bases" / f"tiny-{entry.key}" and entry.hf == entry.dir / "hf"
    assert entry.lock == cache.resolve() / "bases" / f"tiny-{entry.key}.lock"
    assert not (cache / "bases").exists()  # computing a key builds nothing


def test_default_cache_is_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMTRAIN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bases.cache_root() == tmp_path.resolve() / ".cache" / "llmtrain"


def test_key_follows_the_config_and_the_data(tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml")
    key = bases.base_entry(str(recipe), compose_config).key
    assert bases.base_entry(str(recipe), compose_config).key == key  # deterministic
    write_recipe(recipe, TINY_BASE.replace("max_steps: 2", "max_steps: 3"))
    assert bases.base_entry(str(recipe), compose_config).key != key
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "reverse: ab\\n", "response": "ba"}\n')
    write_recipe(recipe, TINY_BASE + f"data:\n  train_files: [{data}]\n")
    with_data = bases.base_entry(str(recipe), compose_config).key
    data.write_text('{"prompt": "reverse: abc\\n", "response": "cba"}\n')
    assert bases.base_entry(str(recipe), compose_config).key != with_data  # same path, other contents


def test_key_ignores_output_dir_logger_and_locations(tmp_path, monkeypatch):
    key = bases.base_entry(str(write_recipe(tmp_path / "tiny.yaml")), compose_config).key
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = write_recipe(elsewhere / "tiny.yaml", TINY_BASE + "output_dir: /somewhere/else\n"
                         "logger:\n  wandb:\n    enabled: true\n")
    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path / "other_cache"))
    assert bases.base_entry(str(moved), compose_config).key == key


def test_a_shipped_recipe_by_name_or_by_path_is_one_entry():
    by_name = bases.base_entry("sft_tiny", compose_config)
    by_path = bases.base_entry(str(recipes_dir() / "sft_tiny.yaml"), compose_config)
    assert by_name.dir == by_path.dir and by_name.name == "sft_tiny"
    assert bases._build_ref("sft_tiny") == "sft_tiny"


def test_unknown_base_names_the_choices(tmp_path):
    recipe = write_recipe(tmp_path / "user.yaml", uses_base("no_such_recipe"))
    with pytest.raises(ConfigError, match=r"\$\{base:no_such_recipe\}: no such recipe; name one of .*sft_tiny"):
        compose_config([f"recipe={recipe}"])


def test_cycles_are_named(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_recipe(a, uses_base(str(b)))
    write_recipe(b, uses_base(str(a)))
    with pytest.raises(ConfigError, match=r"base recipes form a cycle: b -> a -> b"):
        compose_config([f"recipe={a}"])
    selfish = write_recipe(tmp_path / "self.yaml", uses_base(str(tmp_path / "self.yaml")))
    with pytest.raises(ConfigError, match=r"cycle: self -> self"):
        bases.resolve_base(str(selfish), compose_config)
    assert bases._resolving == [] and not (tmp_path / "cache" / "bases").exists()  # nothing built or locked


def test_build_env_drops_every_launcher_variable(monkeypatch):
    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/tmp/e.json",
                "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "TORCH_ELASTIC_WORKER_IDENTICAL": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "2"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = bases.build_env()
    assert not set(torchrun) & set(env)
    assert env["LLMTRAIN_CACHE"] and env["PYTHONPATH"].split(":") == [str(Path(bases.__file__).parents[1]),
                                                                      "/somewhere"]


def test_final_metrics_reads_the_last_train_and_eval_records(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "eval_loss": 5.0, "eval_accuracy": 0.1}\n{"step": 1, "loss": 4.0}\n'
                       '{"step": 2, "loss": 3.0}\n{"step": 2, "eval_loss": 2.5, "eval_accuracy": 0.4}\n')
    assert bases.final_metrics(metrics) == {"steps": 2, "final_train_loss": 3.0, "eval_step": 2,
                                            "eval_loss": 2.5, "eval_accuracy": 0.4}
    assert bases.final_metrics(tmp_path / "missing.jsonl") == {}
