"""Every problem with a config that can be found without the model weights or the data, collected from each
component that owns a field: the schema (config.py), the registries' names, the backend, the stage, peft.

Runs on every rank before any model loads; all problems are raised together as one ConfigError whose lines each
name the field and the fix.
"""

from __future__ import annotations

from typing import Any

from llmtrain.backends import BACKENDS, backend_problems, backends_that, data_parallel_size
from llmtrain.backends.pipeline_checks import run_problems as pipeline_problems
from llmtrain.config import ConfigError, batch_problems, choice_problems, schema_problems
from llmtrain.data.formats import FORMATS
from llmtrain.data.prompts import PROMPT_FORMATS
from llmtrain.metrics.straggler import straggler_problems
from llmtrain.models.liger import fused_loss_problems
from llmtrain.models.load import family_attention_problems, local_model_config
from llmtrain.models.lora_checks import PEFT_METHODS, peft_problems, qlora_problems
from llmtrain.optim.spec import OPTIMIZERS, optim_problems
from llmtrain.sequence_parallel import sp_problems
from llmtrain.spikes import spike_problems
from llmtrain.stages.registry import stage_names, stage_roles, stage_spec

DATA_FORMATS = (*FORMATS, *(f for f in PROMPT_FORMATS if f not in FORMATS))


def registry_choices() -> dict[str, tuple]:
    return {"data.format": DATA_FORMATS, "backend.name": tuple(BACKENDS), "stage.name": stage_names(),
            "peft.name": PEFT_METHODS}


def stage_problems(cfg: Any, dp: int = 1) -> list[str]:
    """The chosen stage's own fields, and what it needs from data and model (`dp`: the data-parallel size)."""
    if cfg.stage.name not in stage_names():
        return []  # named by the choices
    spec = stage_spec(cfg.stage.name)
    problems = []
    if cfg.data.format not in spec.data_formats:
        problems.append(f"stage {spec.name} {spec.data_hint.format(format=repr(cfg.data.format))}")
    return problems + spec.problems(cfg, dp) + unread_node_problems(cfg, spec.config_node)


def unread_node_problems(cfg: Any, read_node: str | None) -> list[str]:
    """Fields of another stage's config node set away from their defaults: this stage never reads them (e.g.
    ppo.rollout.engine=vllm on stage=sft would sample nothing), so they are refused rather than ignored."""
    import dataclasses

    from omegaconf import OmegaConf

    problems, seen = [], {read_node}
    for other in (stage_spec(name) for name in stage_names()):
        node = other.config_node
        if node in seen or node not in cfg or other.config_class is None:
            continue
        seen.add(node)
        changed = _changed(OmegaConf.to_container(cfg[node], resolve=True), dataclasses.asdict(other.config_class()))
        problems += [f"{node}.{name} is set but stage={cfg.stage.name} does not read it (stage {other.name} "
                     f"does): drop it, or choose that stage" for name in changed]
    return problems


def _changed(values: dict, defaults: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            out += _changed(value, default, f"{prefix}{key}.")
        elif value != default:
            out.append(prefix + key)
    return out


def config_problems(cfg: Any, world_size: int) -> list[str]:
    problems = schema_problems(cfg) + choice_problems(cfg, registry_choices())
    dp = data_parallel_size(cfg.backend, world_size)
    problems += batch_problems(cfg.trainer, dp)
    problems += straggler_problems(cfg.trainer)
    problems += backend_problems(cfg.backend, world_size)
    problems += stage_problems(cfg, dp)
    problems += peft_problems(cfg.peft, cfg.backend, reference_off_adapters(cfg))
    problems += attention_problems(cfg)
    problems += sp_problems(cfg)
    problems += pipeline_problems(cfg, stage_spec(cfg.stage.name))
    problems += head_problems(cfg)
    problems += optim_problems(cfg) + _backend_optimizer_problems(cfg)
    problems += async_save_problems(cfg)
    problems += spike_problems(cfg, backends_that("updates_in_clip"))
    return problems + qlora_problems(cfg, backends_that("loads_4bit_base"))


def _backend_optimizer_problems(cfg: Any) -> list[str]:
    spec = BACKENDS.get(cfg.backend.name)
    return [] if spec is None or cfg.optim.name not in OPTIMIZERS else spec.optimizer_problems(cfg.backend, cfg)


def async_save_problems(cfg: Any) -> list[str]:
    """trainer.async_save on a backend without a background writer (BackendSpec.no_async_save says why)."""
    spec = BACKENDS.get(cfg.backend.name)
    if not cfg.trainer.async_save or spec is None or not spec.no_async_save:
        return []
    able = ", ".join(name for name, other in BACKENDS.items() if not other.no_async_save)
    return [f"trainer.async_save=true with backend={cfg.backend.name}: {spec.no_async_save}; set "
            f"trainer.async_save=false (or choose a backend that writes in the background: {able})"]


def head_problems(cfg: Any) -> list[str]:
    """An explicit model.fused_loss=liger this device, layout or stage cannot run (models/liger.py)."""
    if cfg.stage.name not in stage_names():
        return []
    from llmtrain.distributed import resolve_device

    return fused_loss_problems(cfg, resolve_device(cfg.device).type, stage_spec(cfg.stage.name).lm_loss_sum)


def attention_problems(cfg: Any) -> list[str]:
    """An explicit model.attn_implementation the family's transformers class lacks (Gemma-2 has no sdpa), read from
    each role's architecture config alone (model.from_config, a local config.json, model.config_path): refused here,
    on every rank, before any weights load. A hub id without config_path is checked when it loads (models/load.py)."""
    if cfg.model.attn_implementation == "auto" or cfg.stage.name not in stage_names():
        return []
    configs = [local_model_config(spec.source) for spec in stage_roles(cfg).values()]
    return family_attention_problems(cfg.model.attn_implementation, [c for c in configs if c is not None])


def reference_off_adapters(cfg: Any) -> str | None:
    """The stage whose frozen reference is, under peft=lora, the policy with its adapters disabled (None: none)."""
    if cfg.stage.name not in stage_names():
        return None
    roles = stage_roles(cfg)
    return cfg.stage.name if any(spec.adapter_off_of for spec in roles.values()) else None


def reference_links(problems: list[str], cfg: Any) -> str:
    """Where the configuration reference (docs/reference/config.md, generated from the schema: a section per group,
    the backend's by its name) lists the fields these problems name."""
    import re

    from llmtrain.paths import docs_page

    named = {match.group(1) for problem in problems for match in re.finditer(r"\b([a-z_]+)\.[a-z_]+", problem)}
    anchors = [f"#{group}" for group in cfg if group in named and group != "backend"]
    if "backend" in named:
        anchors.append(f"#backend-{cfg.backend.name}")
    return f"every field and its values: {docs_page('reference/config.md')}" + (
        f" ({', '.join(anchors)})" if anchors else "")


def validate(cfg: Any, world_size: int) -> None:
    problems = config_problems(cfg, world_size)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems) + "\n"
                          + reference_links(problems, cfg))
