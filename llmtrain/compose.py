"""Turns `recipe=NAME key=value ...` into a resolved, typed config with Hydra's compose API.

A recipe is a primary config (recipes/NAME.yaml) whose defaults list starts from conf/config.yaml
and overrides groups; command-line group choices (`backend=...`) win over the recipe's. The compose
API (not @hydra.main) keeps Hydra from changing the working directory or writing outputs/.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmtrain.config import ConfigError
from llmtrain.paths import ASSETS_DIR, available_recipes, conf_dir, recipes_dir
from llmtrain.schema import register_schema


def _register_resolvers() -> None:
    """`${asset:REL}`: a file shipped in llmtrain/assets. `${base:RECIPE}`: that recipe's trained hf/ export,
    built once into a cache (llmtrain/bases.py)."""
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", lambda rel: str(ASSETS_DIR / rel))
    if not OmegaConf.has_resolver("base"):
        from llmtrain.bases import resolve_base

        # the base recipe's own config is composed here too (nested: it may have bases of its own)
        OmegaConf.register_new_resolver("base", lambda ref: resolve_base(ref, compose_config))


def split_recipe(overrides: list[str]) -> tuple[str, list[str]]:
    recipe = [o for o in overrides if o.startswith("recipe=")]
    rest = [o for o in overrides if not o.startswith("recipe=")]
    if not recipe:
        raise ConfigError(f"pass recipe=NAME, one of: {', '.join(available_recipes())} "
                          "(or recipe=/path/to/your_recipe.yaml)")
    return recipe[-1].split("=", 1)[1], rest


def _own_error(error: BaseException) -> ConfigError | None:
    while error is not None and not isinstance(error, ConfigError):
        error = error.__cause__ or error.__context__
    return error


FROM_CONFIG = "model.from_config"


def split_from_config(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the `model.from_config...` overrides, the others), each in command-line order."""
    def ours(override: str) -> bool:
        key = override.lstrip("+~").split("=", 1)[0]
        return key == FROM_CONFIG or key.startswith(FROM_CONFIG + ".")
    return [o for o in overrides if ours(o)], [o for o in overrides if not ours(o)]


def apply_from_config(cfg: DictConfig, overrides: list[str]) -> None:
    """`model.from_config` holds `model_type` plus the fields of that transformers config class, so its keys
    are not known in advance: Hydra's struct mode would refuse each new one (`Key 'n_embd' is not in
    struct`), and cannot replace the group's dict. Its overrides apply here, after the groups, in order:
    `model.from_config=null` empties it, `model.from_config={...}` replaces it, `model.from_config.KEY=VALUE`
    sets one field (creating the dict; a dotted KEY reaches into a nested dict), `~model.from_config.KEY`
    drops one. Which fields the class has is checked later (`models.load.model_config`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    node = cfg.model.from_config
    fields = None if node is None else OmegaConf.to_container(node)
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            raise ConfigError(f"{override.input_line}: one value only (no sweeps)")
        path = [p for p in override.key_or_group[len(FROM_CONFIG):].split(".") if p]
        value = None if override.is_delete() else override.value()
        if not path:
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{override.input_line}: model.from_config is null or a mapping "
                                  "{model_type: ..., field: value, ...}")
            fields = value
            continue
        if fields is None:
            fields = {}
        parent = fields
        for part in path[:-1]:
            parent = parent.setdefault(part, {})
            if not isinstance(parent, dict):
                raise ConfigError(f"{override.input_line}: model.from_config.{part} is not a mapping")
        if override.is_delete():
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = value
    cfg.model.from_config = fields


def unknown_key_message(error: BaseException) -> str | None:
    """The project's message for a key the schema does not have (`model.fused_loss`, `trainer.max_step`): the node's
    fields, the closest ones, and where else a field of that name lives. None: another error."""
    import difflib

    from llmtrain.schema import full_schema

    while error is not None and not isinstance(getattr(error, "full_key", None), str):
        error = error.__cause__ or error.__context__
    if error is None or not isinstance(error, OmegaConfBaseException) or "not in" not in str(error):
        return None
    key = error.full_key
    parent, _, name = key.rpartition(".")
    schema = OmegaConf.structured(full_schema())
    node = OmegaConf.select(schema, parent) if parent else schema
    if not isinstance(node, DictConfig):
        return None
    fields = [str(k) for k in node.keys()]
    close = difflib.get_close_matches(name, fields, n=2)
    elsewhere = [f"{where}.{name}" for where in schema.keys()
                 if isinstance(schema[where], DictConfig) and name in schema[where] and where != parent]
    candidates = [f"{parent}.{c}" if parent else c for c in close] + elsewhere
    hints = [f"did you mean {' or '.join(candidates)}?"] if candidates else []
    where = parent or "the config's top level"
    return (f"config: {key} is not a field of {where}; {'; '.join(hints) + '; ' if hints else ''}"
            f"{where} has: {', '.join(fields)}")


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose, resolve interpolations, and return a read-only typed config."""
    register_schema()
    _register_resolvers()
    recipe, rest = split_recipe(overrides)
    from_config, rest = split_from_config(rest)
    recipe_path = Path(recipe)
    if recipe_path.suffix in (".yaml", ".yml"):
        primary_dir, name = recipe_path.resolve().parent, recipe_path.stem
    else:
        primary_dir, name = recipes_dir(), recipe
        if name not in available_recipes():
            raise ConfigError(f"recipe={name} does not exist; available: {', '.join(available_recipes())}")
    try:
        with initialize_config_dir(str(primary_dir), version_base=None):
            cfg = compose(name, overrides=[f"hydra.searchpath=[file://{conf_dir()}]", f"recipe={name}", *rest])
        # Outside the `with`: Hydra's global state is cleared again, so a resolver may compose another
        # recipe (${base:...} composes the base recipe to find its cache key).
        apply_from_config(cfg, from_config)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as error:
        own = _own_error(error)
        if own is not None:  # a resolver's ConfigError (a failed base build, a cycle): its message as is
            raise own from None
        from llmtrain.backends import misplaced_key_message

        misplaced = misplaced_key_message(error)  # backend.KEY of another backend's group: says which, and how
        if misplaced is not None:
            raise ConfigError(misplaced) from None
        unknown = unknown_key_message(error)
        if unknown is not None:
            raise ConfigError(unknown) from None
        cause = f": {error.__cause__}" if error.__cause__ else ""
        raise ConfigError(f"config: {error}{cause}".split("\n    full_key")[0]) from None
    if cfg.output_dir is None:
        cfg.output_dir = f"runs/{name}"
    OmegaConf.set_readonly(cfg, True)
    return cfg
