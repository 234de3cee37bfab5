"""Backends by name; each module is imported only when chosen (only deepspeed.py imports deepspeed)."""

from __future__ import annotations

import importlib

from llmtrain.parallel import DistContext

BACKENDS = {"ddp": ("llmtrain.backends.ddp", "DDPBackend")}


def build_backend(name: str, ctx: DistContext, precision: str):
    module_name, class_name = BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)(ctx, precision)
