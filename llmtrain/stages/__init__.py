"""Stages by name. A builder maps the config onto a stage's plain arguments (config stops at builders);
each stage module is imported only when chosen."""

from __future__ import annotations

import importlib

from llmtrain.stages.base import ModelSource

# name -> (module, builder function): builder(cfg, source, tokenizer) -> Stage
STAGES = {"pretrain": ("llmtrain.stages.causal_lm", "build"), "sft": ("llmtrain.stages.causal_lm", "build"),
          "reward": ("llmtrain.stages.reward", "build"), "dpo": ("llmtrain.stages.dpo", "build"),
          "ppo": ("llmtrain.stages.ppo.build", "build"), "grpo": ("llmtrain.stages.ppo.build", "build")}


def model_source(model_cfg) -> ModelSource:
    """The run's `model.*` weights source (roles built from the run's model use it)."""
    from_config = None if model_cfg.from_config is None else dict(model_cfg.from_config)
    return ModelSource(model_cfg.name_or_path, from_config, model_cfg.config_path, model_cfg.trust_remote_code)


# name -> {role: trainable}: what the planner reports before any stage is built (each stage's `roles` agrees)
ROLES = {"pretrain": {"policy": True}, "sft": {"policy": True}, "reward": {"reward": True},
         "dpo": {"policy": True, "reference": False},
         # PPO with a reward model; with ppo.reward.function there is no reward role (stages/ppo/build.ppo_roles)
         "ppo": {"actor": True, "critic": True, "reference": False, "reward": False},
         "grpo": {"actor": True, "reference": False}}

# roles whose model ends in a scalar head (hidden -> 1) rather than the LM head, in every stage that has them
SCALAR_HEAD_ROLES = frozenset({"reward", "critic"})


def stage_roles(name: str, cfg=None) -> dict[str, bool]:
    """{role: trainable}; with the config, PPO's roles as this run builds them (stages/ppo/build.ppo_roles)."""
    if cfg is None or name not in ("ppo", "grpo"):
        return ROLES[name]
    from llmtrain.stages.ppo.build import ppo_roles

    return {role: spec.trainable for role, spec in ppo_roles(cfg, model_source(cfg.model)).items()}


def build_stage(cfg, tokenizer, attn_implementation: str):
    """`attn_implementation`: the resolved attention (pairs go padding-free where it isolates sequences)."""
    module_name, builder = STAGES[cfg.stage.name]
    module = importlib.import_module(module_name)
    return getattr(module, builder)(cfg, model_source(cfg.model), tokenizer, attn_implementation)
