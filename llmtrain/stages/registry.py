"""Every stage by name: each module listed here declares `STAGE_SPECS` (stages/spec.py). The rest of the program
asks this registry what a stage is; a new stage adds its module to `STAGE_MODULES`, nothing else outside stages/."""

from __future__ import annotations

import importlib
from functools import cache

from llmtrain.data.pipeline import load_data
from llmtrain.stages.base import ModelSource
from llmtrain.stages.spec import StageSpec

STAGE_MODULES = ("llmtrain.stages.causal_lm", "llmtrain.stages.reward", "llmtrain.stages.dpo",
                 "llmtrain.stages.ppo.build", "llmtrain.stages.simpo", "llmtrain.stages.orpo",
                 "llmtrain.stages.kto")


@cache
def stage_specs() -> dict[str, StageSpec]:
    specs = {}
    for module in STAGE_MODULES:
        for spec in importlib.import_module(module).STAGE_SPECS:
            specs[spec.name] = spec
    return specs


def stage_spec(name: str) -> StageSpec:
    return stage_specs()[name]


def stage_names() -> tuple[str, ...]:
    return tuple(stage_specs())


def config_nodes() -> dict[str, type]:
    """{top-level node: dataclass} of every stage that owns one (sibling stages share theirs: ppo and grpo)."""
    return {spec.config_node: spec.config_class for spec in stage_specs().values() if spec.config_node}


def decide_attention(cfg, resolved: str, for_family) -> str:
    """The run's attention, decided once, read by the stage, the batches, the models and the planner alike.

    `resolved`: model.attn_implementation resolved for the device (models/load.resolve_attn_implementation, or the
    planner's pick for a planned GPU); `for_family(attn) -> attn`: what each role's class runs instead where it lacks
    it (the run: models/load.attention_for_family on the roles' configs; the planner: the meta model's facts).
    In order: Ulysses (backend.sp > 1) exchanges around sdpa_segments, ring attention (backend.cp > 1) stands for
    it; the family's support; the stage's own need
    (PPO's left-padded rollouts read a padding mask: StageSpec.attention), checked against the family again."""
    from llmtrain.models.attention import SEGMENT_ATTENTION
    from llmtrain.parallel import row_degrees

    attn = for_family(SEGMENT_ATTENTION if row_degrees(cfg.backend) else resolved)
    adjust = stage_spec(cfg.stage.name).attention
    return attn if adjust is None else for_family(adjust(cfg, attn))


def model_source(model_cfg) -> ModelSource:
    """The run's `model.*` weights source (roles built from the run's model use it)."""
    from_config = None if model_cfg.from_config is None else dict(model_cfg.from_config)
    return ModelSource(model_cfg.name_or_path, from_config, model_cfg.config_path, model_cfg.trust_remote_code)


def stage_roles(cfg) -> dict:
    """{role: RoleSpec} as this config builds them (the planner and the run agree on it)."""
    return stage_spec(cfg.stage.name).roles(cfg, model_source(cfg.model))


def build_stage(cfg, tokenizer, attn_implementation: str):
    """`attn_implementation`: the resolved attention (pairs go padding-free where it isolates sequences)."""
    return stage_spec(cfg.stage.name).build(cfg, model_source(cfg.model), tokenizer, attn_implementation)


def load_stage_data(cfg, tokenizer):
    """The run's data as its stage reads it: prompts for RL, pairs or sequences otherwise (data/pipeline.py)."""
    spec = stage_spec(cfg.stage.name)
    return load_data(cfg.data, tokenizer=tokenizer, seed=cfg.trainer.seed,
                     max_prompt_len=spec.max_prompt_len(cfg) if spec.prompts else None,
                     rename_columns=spec.column_renames(cfg), unpaired=spec.unpaired)
