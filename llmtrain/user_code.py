"""The user's own code, named `module:attribute` in the config (reward functions, tools, environment factories)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from llmtrain.config import ConfigError


def load_attribute(spec: str, field: str, example: str = "my_module:name") -> Callable:
    """`module:attribute` -> the callable; errors name the field and the fix."""
    module_name, _, attribute = str(spec).partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{field}={spec!r} must be module:attribute (e.g. {example}, with {example.split(':')[0]}.py "
                          "on PYTHONPATH)")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an ImportError, or the module's own code failing on import
        raise ConfigError(f"{field}={spec!r}: cannot import {module_name!r} ({type(error).__name__}: {error}); "
                          "put its folder on PYTHONPATH and check that it imports") from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"{field}={spec!r}: {module_name} has no callable {attribute!r}")
    return function
