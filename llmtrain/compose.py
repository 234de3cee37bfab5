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

from llmtrain.config import ConfigError, register_schema

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "assets"


def _shipped_dir(name: str) -> Path:
    """conf/ or recipes/: beside the package in a checkout, inside it (as _conf/_recipes) when installed."""
    for candidate in (PACKAGE_DIR.parent / name, PACKAGE_DIR / f"_{name}"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"llmtrain cannot find its {name}/ directory next to {PACKAGE_DIR}")


def conf_dir() -> Path:
    return _shipped_dir("conf")


def recipes_dir() -> Path:
    return _shipped_dir("recipes")


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def _register_resolvers() -> None:
    """`${asset:REL}`: a file shipped in llmtrain/assets. `${base:RECIPE}`: that recipe's trained hf/ export,
    built once into a cache (llmtrain/bases.py)."""
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", lambda rel: str(ASSETS_DIR / rel))
    if not OmegaConf.has_resolver("base"):
        from llmtrain.bases import resolve_base

        OmegaConf.register_new_resolver("base", resolve_base)


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


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose, resolve interpolations, and return a read-only typed config."""
    register_schema()
    _register_resolvers()
    recipe, rest = split_recipe(overrides)
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
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as error:
        own = _own_error(error)
        if own is not None:  # a resolver's ConfigError (a failed base build, a cycle): its message as is
            raise own from None
        cause = f": {error.__cause__}" if error.__cause__ else ""
        raise ConfigError(f"config: {error}{cause}".split("\n    full_key")[0]) from None
    if cfg.output_dir is None:
        cfg.output_dir = f"runs/{name}"
    OmegaConf.set_readonly(cfg, True)
    return cfg
