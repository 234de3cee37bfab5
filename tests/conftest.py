"""Fixtures shared by every test folder: a saved tiny model folder every contender loads, and the base-model cache.
Plain helpers (CLI runners, metrics readers, paths) are in tests/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# the helpers' asserts explain themselves in a failure report, as the tests' own do
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers import REPO, save_tiny_model, vllm_environment  # noqa: E402  (after the registration)

# Trained base models (${base:...}, llmtrain/bases.py) are built once into <repo>/.cache and reused by
# every later test run and CLI subprocess; a test that must build one sets its own LLMTRAIN_CACHE.
os.environ.setdefault("LLMTRAIN_CACHE", str(REPO / ".cache"))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (the dev extra): without it, nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    """The README's `-n 2`: every test that launches processes (outside tests/unit) is one work unit, run in order
    on one worker (they use both cores; their module fixtures, timings and the vLLM session assume the order), and
    the in-process unit tests, one by one, fill the other core beside them. (Not xdist's `--dist loadgroup`: with
    pytest 9 it does not group, pytest-xdist 3.8 renames a node id attribute pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class LaunchesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if Path(nodeid.split("::")[0]).parent.name == "unit" else "launches"

    return LaunchesOnOneWorker(config, log)


def pytest_collection_modifyitems(config, items):
    """The unit tests that resolve a trained base (marked uses_base) run after the other unit tests: CI builds the
    bases in the background while the unit tests run (.ci/run), so by then they wait for nothing."""
    unit = [i for i, item in enumerate(items) if Path(item.fspath).parent.name == "unit"]
    if not unit:
        return
    first, last = unit[0], unit[-1] + 1
    block = items[first:last]
    needs_base = [item for item in block if item.get_closest_marker("uses_base")]
    items[first:last] = [item for item in block if not item.get_closest_marker("uses_base")] + needs_base


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The rollout engine's interpreter: $LLMTRAIN_VLLM_PYTHON (.ci/run builds it beside the unit tests), else built
    here once into <repo>/.cache/vllm-env by launch/vllm_env.sh (vLLM lives apart from llmtrain's transformers)."""
    return vllm_environment()


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """A model of conf/model/tiny_llama.yaml's architecture (the recipes' sft_tiny base), randomly initialised: what
    the engine serves until a run pushes its own weights (vLLM's CPU attention needs heads of 32 or more dimensions,
    tiny_model_dir's have 16)."""
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    from_config = yaml.safe_load((REPO / "conf" / "model" / "tiny_llama.yaml").read_text())["from_config"]
    directory = tmp_path_factory.mktemp("vllm_llama")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(vocab_size=263, **from_config)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def vllm_server(vllm_python, vllm_model_dir, tmp_path_factory):
    """One vLLM CPU server for the test session, started by llmtrain's own server code on the tiny model (the runs
    that use it push their own weights into it before they sample), stopped at the end."""
    from llmtrain.stages.ppo.engines.vllm_server import ServerSettings, VLLMServer

    # 512: the tool-calling tests' prompts render the tool's schema (~310 tokens) before up to 144 new tokens
    settings = ServerSettings(python=vllm_python, precision="fp32", max_model_len=512, start_timeout_s=600)
    server = VLLMServer(settings, vllm_model_dir, tmp_path_factory.mktemp("vllm") / "server.log", gpu=False)
    try:
        yield server
    finally:
        server.stop()
