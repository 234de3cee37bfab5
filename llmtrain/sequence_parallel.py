"""What `backend.sp > 1` (Ulysses sequence parallelism: models/ulysses.py) and `backend.cp > 1` (ring attention:
models/ring_attention.py), both on data/sequence_shard.py's shards, need of the rest of the config, checked on every
rank before any model loads (validation.py): the stage, the attention, the model family, dropout, LoRA. Each line
names the field and the fix. (The heads: models/ulysses_checks.py; cp's model checks: parallel/cp.py.)"""

from __future__ import annotations

from typing import Any

from llmtrain.models.attention import SEGMENT_ATTENTION
from llmtrain.models.load import local_model_config, unsupported_attention
from llmtrain.parallel import degrees_of, row_degrees
from llmtrain.parallel.cp import config_problems as cp_config_problems
from llmtrain.stages.registry import stage_names, stage_roles, stage_spec

SP_ATTENTIONS = ("auto", SEGMENT_ATTENTION)  # the attention run on whole rows after the exchange (in the ring's blocks)


def sp_problems(cfg: Any) -> list[str]:
    """The stage, the attention and the model family under backend.sp > 1 or backend.cp > 1."""
    shared = row_degrees(cfg.backend)  # none for a backend without the fields (ddp)
    if not shared or cfg.stage.name not in stage_names():
        return []
    spec, problems = stage_spec(cfg.stage.name), []
    field = " and ".join(f"backend.{name}={degree}" for name, degree in shared.items())
    unset = " and ".join(f"backend.{name}=1" for name in shared)
    if not spec.sequence_parallel:
        runs = ", ".join(f"stage={name}" for name in stage_names() if stage_spec(name).sequence_parallel)
        problems.append(f"{field}: stage {spec.name} {_stage_reason(spec)}; set {unset} (sequence/context "
                        f"parallelism runs {runs})")
    if cfg.model.attn_implementation not in SP_ATTENTIONS:
        problems.append(f"model.attn_implementation={cfg.model.attn_implementation} with {field}: the rows' shards "
                        f"attend with {SEGMENT_ATTENTION} (after Ulysses' all-to-all, in each block of the ring; it "
                        f"keeps packed samples apart); set model.attn_implementation={SEGMENT_ATTENTION} or auto")
    if cfg.peft.name != "none":
        problems.append(f"peft={cfg.peft.name} with {field}: adapters over sequence shards (their gradients "
                        f"summed over the peers, DPO's adapter-off reference on the shards) have never been run "
                        f"and checked against whole rows; set {unset} or peft=none")
    if cfg.model.dropout > 0:
        problems.append(f"model.dropout={cfg.model.dropout} with {field}: peers sharing a row draw the same dropout "
                        "masks for different tokens (and the ring runs without attention dropout); set "
                        "model.dropout=0")
    if spec.sequence_parallel:
        for source in (role.source for role in stage_roles(cfg).values()):
            config = local_model_config(source)
            if config is not None and unsupported_attention(SEGMENT_ATTENTION, config) is not None:
                problems.append(f"{field}: {config.model_type} runs eager attention only in transformers "
                                f"(no sdpa), which sequence and context parallelism cannot wrap; set {unset}")
    return problems + cp_implementation_problems(cfg)


def cp_implementation_problems(cfg: Any) -> list[str]:
    """backend.cp_implementation=torch where torch's context parallelism cannot run (parallel/cp.py)."""
    from llmtrain.distributed import resolve_device

    return cp_config_problems(cfg, resolve_device(cfg.device).type, bool(cfg.data.packing), degrees_of(cfg.backend))


def _stage_reason(spec) -> str:
    if spec.prompts:
        return ("generates its rollouts on whole sequences (generation is not sharded) and scores them in the "
                "same forward layout: not sequence-parallel yet")
    return "is not sequence-parallel yet"
