"""Fixtures shared by every test folder: a saved tiny model folder every contender loads, and the base-model cache.
Plain helpers (CLI runners, metrics readers, paths) are in tests/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# the helpers' asserts explain themselves in a failure report, as the tests' own do
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers import REPO, save_tiny_model  # noqa: E402  (after the registration)

# Trained base models (${base:...}, llmtrain/bases.py) are built once into <repo>/.cache and reused by
# every later test run and CLI subprocess; a test that must build one sets its own LLMTRAIN_CACHE.
os.environ.setdefault("LLMTRAIN_CACHE", str(REPO / ".cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))
