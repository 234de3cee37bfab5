"""Fixtures of the unit tests: the shipped tokenizer as a run loads it, and the tiny Llama (tests/helpers.py's
tiny_llama_config / tiny_llama, handed out as fixtures so a test names what it builds)."""

from __future__ import annotations

import pytest

from tests import helpers


@pytest.fixture(scope="module")
def tokenizer():
    """llmtrain/assets/tokenizer by models.load.load_tokenizer, as a run loads it (pad = eos, </s> 257; vocabulary
    263). One per test module: a module that changes it changes only its own."""
    from llmtrain.models.load import load_tokenizer

    return load_tokenizer(str(helpers.TOKENIZER_DIR), trust_remote_code=False)


@pytest.fixture(scope="session")
def tiny_llama_config():
    """`tiny_llama_config(**overrides)` -> LlamaConfig: helpers.TINY_LLAMA's sizes with OVERRIDES on top."""
    return helpers.tiny_llama_config


@pytest.fixture(scope="session")
def tiny_llama():
    """`tiny_llama(seed=0, attn_implementation=None, **overrides)` -> a random causal LM of that config, built after
    torch.manual_seed(seed)."""
    return helpers.tiny_llama
