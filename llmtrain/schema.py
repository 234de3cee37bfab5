"""The whole config schema: the run's own fields (config.py) plus each stage's top-level node, assembled from the
stage registry and stored in Hydra's ConfigStore as `schema` (conf/config.yaml starts from it)."""

from __future__ import annotations

from dataclasses import field, make_dataclass
from functools import cache

from hydra.core.config_store import ConfigStore

from llmtrain.backends import register_schemas
from llmtrain.config import RunConfig
from llmtrain.stages.registry import config_nodes


@cache
def full_schema() -> type:
    nodes = [(node, cls, field(default_factory=cls)) for node, cls in config_nodes().items()]
    return make_dataclass("RunSchema", nodes, bases=(RunConfig,))


def register_schema() -> None:
    ConfigStore.instance().store(name="schema", node=full_schema())
    register_schemas()  # each backend's typed group: conf/backend/<preset>.yaml starts from `<name>_schema`
