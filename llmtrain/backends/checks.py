"""Backend config checks that run before anything loads: pure Python, no deepspeed/FSDP import.

`BACKEND_CONFIG_CHECKS[name](backend_cfg, world_size) -> list[str]` sees the config alone;
`BACKEND_MODEL_CHECKS[name](backend_cfg, world_size, arch) -> list[str]` also sees the model's
architecture config (heads, kv-heads, model_type), read from config.json without weights.
Each message names the field and the fix.
"""

from __future__ import annotations

from typing import Any, Callable


def ddp_problems(backend: Any, world_size: int) -> list[str]:
    return []


BACKEND_CONFIG_CHECKS: dict[str, Callable[[Any, int], list[str]]] = {"ddp": ddp_problems}
BACKEND_MODEL_CHECKS: dict[str, Callable[[Any, int, Any], list[str]]] = {}
