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


@pytest.hookimpl(tryfirst=True)  # before xdist's, which turns the group marks into node ids
def pytest_collection_modifyitems(config, items):
    """Every test that launches processes (outside tests/unit) joins one xdist group: under the README's `-n 2
    --dist loadgroup` they run in order on one worker (they use both cores and their timings and fixtures assume
    the order), while the other worker runs the in-process unit tests beside them.

    The unit tests that resolve a trained base (marked uses_base) run after the other unit tests: CI builds the
    bases in the background while the unit tests run (.ci/run), so by then they wait for nothing."""
    for item in items:
        if Path(item.fspath).parent.name != "unit":
            item.add_marker(pytest.mark.xdist_group("launches"))
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
