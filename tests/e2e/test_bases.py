"""${base:...} building real (2-step) bases: concurrent resolvers build once, later ones reuse, the export
loads, launcher variables stay out of the build, failures leave nothing, a base of a base, torchrun."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from llmtrain import bases
from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from tests.helpers import PYTHON, REPO, assert_ok, cli_env, read_metrics, run_cli, uses_base, write_recipe

pytestmark = pytest.mark.e2e

# Resolves a recipe's bases the way every rank does before training: compose its config.
RESOLVE = ("import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
           "from llmtrain.compose import compose_config; "
           "print(compose_config([f'recipe={sys.argv[1]}']).model.name_or_path)")
BUILDING = "building base model"


def torchrun_rank_env(rank: int) -> dict:
    """What torchrun --nproc_per_node 2 gives a worker (none of it may reach the build)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
            "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two "ranks" (torchrun's variables, RANK 0 and 1, WORLD_SIZE 2) compose a recipe whose base is a
    throwaway 2-step recipe, at the same time, into an empty cache."""
    root = tmp_path_factory.mktemp("bases")
    base = write_recipe(root / "tiny_base.yaml")
    user = write_recipe(root / "user.yaml", uses_base(str(base)))
    env = {"LLMTRAIN_CACHE": str(root / "cache")}
    start = time.time()
    procs = [subprocess.Popen([PYTHON, "-c", RESOLVE, str(user)], env=cli_env(**env, **torchrun_rank_env(rank)),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    return {"root": root, "base": base, "user": user, "env": env, "outputs": outputs,
            "seconds": time.time() - start}


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "bases").iterdir() if p.is_dir())


def test_concurrent_resolvers_build_once_and_agree(built):
    (out0, err0), (out1, err1) = built["outputs"]
    assert (err0 + err1).count(BUILDING) == 1, err0 + err1
    [entry] = entries(built["root"] / "cache")
    assert out0.strip() == out1.strip() == str(entry / "hf")
    if BUILDING in err1:  # rank 1 built; rank 0 waited for it, said so, then reused it
        assert "waiting for another process to build base model tiny_base" in err0 and "reusing" in err0
    assert "reusing" not in err1 and "waiting" not in err1  # rank 1 says nothing but its own build


def test_the_build_ran_as_a_world_of_one(built):
    [entry] = entries(built["root"] / "cache")
    saved = yaml.safe_load((entry / "config.yaml").read_text())
    assert saved["run_metadata"]["world_size"] == 1 and saved["device"] == "cpu" and saved["precision"] == "fp32"
    assert "[rank0]" in (entry / "build.log").read_text() and "[rank1]" not in (entry / "build.log").read_text()
    assert not list((built["root"] / "cache" / "bases").glob(".tmp-*"))


def test_the_entry_loads_and_records_its_run(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    [entry] = entries(built["root"] / "cache")
    model = AutoModelForCausalLM.from_pretrained(entry / "hf")
    assert model.config.num_hidden_layers == 2 and len(AutoTokenizer.from_pretrained(entry / "hf")) > 0
    record = json.loads((entry / "base.json").read_text())
    assert record["name"] == "tiny_base" and entry.name == f"tiny_base-{record['key']}"
    assert record["steps"] == 2 and math.isfinite(record["eval_loss"]) and 0 <= record["eval_accuracy"] <= 1
    assert record["versions"]["torch"] and [r["step"] for r in read_metrics(entry)[0]] == [1, 2]


def test_a_later_resolution_reuses_without_building(built, monkeypatch, caplog):
    monkeypatch.setenv("LLMTRAIN_CACHE", built["env"]["LLMTRAIN_CACHE"])
    monkeypatch.delenv("RANK", raising=False)
    [entry] = entries(built["root"] / "cache")
    mtime = (entry / "base.json").stat().st_mtime_ns
    start = time.time()
    with caplog.at_level(logging.INFO, logger="llmtrain.bases"):
        path = bases.resolve_base(str(built["base"]), compose_config)
    assert path == str(entry / "hf") and time.time() - start < 10
    assert "reusing base model tiny_base" in caplog.text and BUILDING not in caplog.text
    assert (entry / "base.json").stat().st_mtime_ns == mtime


def test_a_failing_build_names_the_recipe_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_CACHE", str(tmp_path / "cache"))
    broken = write_recipe(tmp_path / "broken.yaml", "trainer:\n  max_steps: 2\n  global_batch_size: 7\n")
    user = write_recipe(tmp_path / "user.yaml", uses_base(str(broken)))
    from llmtrain.compose import compose_config

    with pytest.raises(bases.BaseBuildError) as error:
        compose_config([f"recipe={user}"])
    message = str(error.value)
    assert message.startswith("base model broken (${base:" + str(broken) + "}) failed to build")
    assert "trainer.global_batch_size=7" in message  # the log's tail
    assert isinstance(error.value, ConfigError)  # the CLI prints it and exits 2
    left = [p.name for p in (tmp_path / "cache" / "bases").iterdir() if p.suffix != ".lock"]
    assert left == [] and not bases.base_entry(str(broken), compose_config).dir.exists()  # no entry, no temp folder


def test_a_base_whose_recipe_has_a_base(built, tmp_path):
    """user.yaml (based on tiny_base) is itself the base of top.yaml: resolving top builds user from the
    cached tiny_base, without rebuilding tiny_base."""
    top = write_recipe(tmp_path / "top.yaml", uses_base(str(built["user"])))
    result = subprocess.run([PYTHON, "-c", RESOLVE, str(top)], env=cli_env(**built["env"]), cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert_ok(result)
    assert result.stderr.count(BUILDING) == 1 and "building base model user once" in result.stderr
    assert "reusing base model tiny_base" in result.stderr
    cache = built["root"] / "cache"
    user_entry = next(p for p in entries(cache) if p.name.startswith("user-"))
    base_entry = next(p for p in entries(cache) if p.name.startswith("tiny_base-"))
    assert result.stdout.strip() == str(user_entry / "hf")
    saved = yaml.safe_load((user_entry / "config.yaml").read_text())
    assert saved["model"]["name_or_path"] == str(base_entry / "hf")


@pytest.mark.dist
def test_torchrun_two_ranks_on_a_fresh_cache(tmp_path):
    """One command under torchrun: the base is built once (by whichever rank locks first), then both ranks
    train from it."""
    base = write_recipe(tmp_path / "tiny_base.yaml")
    user = write_recipe(tmp_path / "user.yaml", uses_base(str(base)))
    run_dir = tmp_path / "run"
    result = run_cli([f"recipe={user}", "trainer.eval_every_n_steps=0", f"output_dir={run_dir}"], nproc=2,
                     env=cli_env(LLMTRAIN_CACHE=str(tmp_path / "cache")))
    assert_ok(result)
    [entry] = entries(tmp_path / "cache")
    assert BUILDING in result.stderr or "waiting for another process to build" in result.stderr
    assert yaml.safe_load((entry / "config.yaml").read_text())["run_metadata"]["world_size"] == 1
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run_metadata"]["world_size"] == 2 and saved["model"]["name_or_path"] == str(entry / "hf")
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2]
