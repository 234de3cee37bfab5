"""ppo.tools and ppo.environment: TRL 1.16's `tools` and `environment_factory`, named as `module:attribute`.

- `ppo.tools=[module:function, ...]`: plain functions (sync or async) with type hints and a Google-style docstring;
  transformers renders their JSON schema into the prompt through the chat template.
- `ppo.environment=module:factory`, or a dict `{name: module:factory}` (each row then picks one by its
  `environment` column): the factory returns an object whose public methods are tools, whose `reset(**row)` is
  called with the row's columns before the rollout and returns None or text appended to the last user message,
  and whose optional `get_reward()` (sync or async) scores every rollout of it, truncated ones included, as a
  reward source of weight 1 named after its class. Instances are pooled and reset, never built per rollout.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from llmtrain.config import ConfigError
from llmtrain.user_code import load_attribute

ENVIRONMENT_COLUMN = "environment"  # the row's choice among a dict of factories (TRL's name)
ENVIRONMENTS_KEYWORD = "environments"  # what reward functions receive: each rollout's instance (TRL's keyword)
NOT_TOOLS = ("reset", "get_reward")


def environment_specs(environment) -> dict:
    """ppo.environment -> {name: spec}: a single factory is the unnamed environment (None) every row uses."""
    if environment is None:
        return {}
    if isinstance(environment, str):
        return {None: environment}
    return {str(name): spec for name, spec in dict(environment).items()}


def tool_methods(instance) -> list[Callable]:
    """An environment's tools: its public functions other than reset and get_reward, bound to the instance (listed on
    the class, as TRL does, so that properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


def schema_problem(function: Callable, field: str) -> str | None:
    """What keeps transformers from rendering `function` as a tool (type hints, a docstring with Args), or None."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(function)
    except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
        return (f"{field}: tool {getattr(function, '__name__', function)!r} cannot be described to the model "
                f"({error}); give it type hints and a Google-style docstring with an Args section")
    return None


class Environments:
    """The factories and their pooled instances: `draw(names)` hands out one instance per rollout, building more only
    when a batch needs more of an environment than exist."""

    def __init__(self, factories: dict):
        self.factories = factories
        self.pool: dict = {name: [] for name in factories}
        self.probes = {name: factory() for name, factory in factories.items()}  # first instance: checked, pooled
        for name, instance in self.probes.items():
            if not callable(getattr(instance, "reset", None)):
                raise ConfigError(f"ppo.environment: the object {type(instance).__name__} built by "
                                  f"{name or 'the factory'} has no callable reset(**row) (TRL's contract)")
            self.pool[name].append(instance)

    @property
    def multiple(self) -> bool:
        return None not in self.factories

    def names_of(self, columns: dict[str, list], rows: int) -> list:
        if not self.multiple:
            return [None] * rows
        chosen = columns.get(ENVIRONMENT_COLUMN)
        if chosen is None:
            raise ConfigError(f"ppo.environment is a dict of factories: each row needs an {ENVIRONMENT_COLUMN!r} "
                              f"column naming one of {sorted(self.factories)}; the data has none")
        unknown = sorted({str(name) for name in chosen if name not in self.factories})
        if unknown:
            raise ConfigError(f"rows name environment(s) {unknown}, not among ppo.environment's "
                              f"{sorted(self.factories)}")
        return list(chosen)

    def draw(self, names: list) -> list:
        cursor: dict = {}
        drawn = []
        for name in names:
            index = cursor.get(name, 0)
            if index == len(self.pool[name]):
                self.pool[name].append(self.factories[name]())
            cursor[name] = index + 1
            drawn.append(self.pool[name][index])
        return drawn

    def reward_functions(self) -> list:
        """One reward source per environment class that defines get_reward (TRL: weight 1, named after the class;
        a rollout of another class gets None, unscored by it)."""
        from llmtrain.stages.ppo.rewards import RewardFunction

        kinds = []
        for instance in self.probes.values():
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in kinds:
                kinds.append(type(instance))
        return [RewardFunction(kind.__name__, environment_reward(kind)) for kind in kinds]


def environment_reward(kind: type) -> Callable:
    def get_reward(*, environments: list, **kwargs) -> list:
        del kwargs
        scores = []
        for environment in environments:
            score = environment.get_reward() if type(environment) is kind else None
            scores.append(asyncio.run(score) if inspect.isawaitable(score) else score)
        return scores

    get_reward.__qualname__ = f"{kind.__name__}.get_reward"
    return get_reward


def load_environments(environment) -> Environments | None:
    specs = environment_specs(environment)
    if not specs:
        return None
    factories = {name: load_attribute(spec, "ppo.environment" if name is None else f"ppo.environment.{name}")
                 for name, spec in specs.items()}
    return Environments(factories)


def load_tools(specs: list[str]) -> list[Callable]:
    return [load_attribute(spec, "ppo.tools", example="my_tools:calculator") for spec in specs]
