"""What `backend.sp > 1` (Ulysses sequence parallelism: models/ulysses.py, data/sequence_shard.py) needs of the
rest of the config, checked on every rank before any model loads (validation.py): the stage, the attention, the
model family, dropout, LoRA. Each line names the field and the fix. (The heads: models/ulysses_checks.py.)"""

from __future__ import annotations

from typing import Any

from llmtrain.models.attention import SEGMENT_ATTENTION
from llmtrain.models.load import local_model_config, unsupported_attention
from llmtrain.parallel import degree_of
from llmtrain.stages.registry import stage_names, stage_roles, stage_spec

SP_ATTENTIONS = ("auto", SEGMENT_ATTENTION)  # the attention run on whole rows after the exchange


def sp_problems(cfg: Any) -> list[str]:
    """The stage, the attention and the model family under backend.sp > 1."""
    sp = degree_of(cfg.backend, "sp")  # 1 for a backend without the field (ddp)
    if sp == 1 or cfg.stage.name not in stage_names():
        return []
    spec, problems = stage_spec(cfg.stage.name), []
    if not spec.sequence_parallel:
        runs = ", ".join(f"stage={name}" for name in stage_names() if stage_spec(name).sequence_parallel)
        problems.append(f"backend.sp={sp}: stage {spec.name} {_stage_reason(spec)}; set backend.sp=1 (sequence "
                        f"parallelism runs {runs})")
    if cfg.model.attn_implementation not in SP_ATTENTIONS:
        problems.append(f"model.attn_implementation={cfg.model.attn_implementation} with backend.sp={sp}: after the "
                        f"all-to-all each rank attends over whole rows with {SEGMENT_ATTENTION} (its per-sample "
                        f"attention keeps packed samples apart); set model.attn_implementation={SEGMENT_ATTENTION} "
                        "or auto")
    if cfg.peft.name != "none":
        problems.append(f"peft={cfg.peft.name} with backend.sp={sp}: adapters over sequence shards (their gradients "
                        "summed over the sp peers, DPO's adapter-off reference on the shards) have never been run "
                        "and checked against sp=1; set backend.sp=1 or peft=none")
    if cfg.model.dropout > 0:
        problems.append(f"model.dropout={cfg.model.dropout} with backend.sp={sp}: sp peers draw the same dropout "
                        "masks for different tokens (and heads), not independent ones; set model.dropout=0")
    if spec.sequence_parallel:
        for source in (role.source for role in stage_roles(cfg).values()):
            config = local_model_config(source)
            if config is not None and unsupported_attention(SEGMENT_ATTENTION, config) is not None:
                problems.append(f"backend.sp={sp}: {config.model_type} runs eager attention only in transformers "
                                f"(no sdpa), which sequence parallelism cannot wrap; set backend.sp=1")
    return problems


def _stage_reason(spec) -> str:
    if spec.prompts:
        return ("generates its rollouts on whole sequences (generation is not sharded) and scores them in the "
                "same forward layout: not sequence-parallel yet")
    return "is not sequence-parallel yet"
