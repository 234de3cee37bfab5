"""Backends by name; each module is imported only when chosen (only deepspeed.py imports deepspeed)."""

from __future__ import annotations

import importlib

from llmtrain.parallel import DistContext

BACKENDS = {"ddp": ("llmtrain.backends.ddp", "DDPBackend"),
            "fsdp2": ("llmtrain.backends.fsdp2", "FSDP2Backend"),
            "deepspeed": ("llmtrain.backends.deepspeed", "DeepSpeedBackend")}


def build_backend(name: str, ctx: DistContext, precision: str, options: dict | None = None):
    """`options`: the backend config as a plain dict (cfg.backend); a backend reads the fields it owns."""
    module_name, class_name = BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)(ctx, precision, options or {})
