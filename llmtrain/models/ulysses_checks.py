"""What `backend.sp > 1` (Ulysses sequence parallelism, models/ulysses.py) needs, checked before any model loads:
pure Python on the config and the architecture config (no weights). Each line names the field and the fix."""

from __future__ import annotations

from typing import Any

from llmtrain.models.attention import SEGMENT_ATTENTION

SP_ATTENTIONS = ("auto", SEGMENT_ATTENTION)  # the attention run on whole rows after the exchange


def sp_degree(backend: Any) -> int:
    """backend.sp; 1 for a backend without the field (ddp: refused by name when set, backends.misplaced_key_message)."""
    from llmtrain.backends.spec import sp_of

    return sp_of(backend)


def sp_problems(cfg: Any) -> list[str]:
    """The stage, the attention and the model family under backend.sp > 1."""
    from llmtrain.models.load import local_model_config, unsupported_attention
    from llmtrain.stages.registry import stage_names, stage_roles, stage_spec

    sp = sp_degree(cfg.backend)
    if sp == 1 or cfg.stage.name not in stage_names():
        return []
    spec, problems = stage_spec(cfg.stage.name), []
    if not spec.sequence_parallel:
        problems.append(f"backend.sp={sp}: stage {spec.name} {_stage_reason(spec)}; set backend.sp=1 (sequence "
                        "parallelism runs stage=pretrain and stage=sft)")
    if cfg.model.attn_implementation not in SP_ATTENTIONS:
        problems.append(f"model.attn_implementation={cfg.model.attn_implementation} with backend.sp={sp}: after the "
                        f"all-to-all each rank attends over whole rows with {SEGMENT_ATTENTION} (its per-sample "
                        f"attention keeps packed samples apart); set model.attn_implementation={SEGMENT_ATTENTION} "
                        "or auto")
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
    if spec.pair_scores == "scalar":
        return ("reads one score per sequence at its last token, which may live on another sp rank: not "
                "sequence-parallel yet")
    if spec.pairs:
        return "sums each response's log-probs per sequence, which sp ranks hold in parts: not sequence-parallel yet"
    return "is not sequence-parallel yet"


def sp_model_problems(sp: int, tp: int, arch: Any) -> list[str]:
    """Query heads split over sp × tp; kv-heads over tp, then over sp or repeated up to it (each must divide the
    other: KV/tp = 2 with sp = 4 repeats each kv-head twice)."""
    if sp <= 1:
        return []
    heads = arch.num_attention_heads
    kv = (getattr(arch, "num_key_value_heads", None) or heads) // max(tp, 1)
    layout = f"backend.sp={sp} × backend.tp={tp}" if tp > 1 else f"backend.sp={sp}"
    fits = [d for d in range(1, heads + 1) if heads % (d * tp) == 0]
    if sp * tp > heads:
        return [f"{layout} = {sp * tp} is more than the model's {heads} query heads ({arch.model_type}): each sp × tp "
                f"rank needs a head of its own; pick backend.sp among {fits}"]
    if heads % (sp * tp):
        return [f"{layout} must divide the model's num_attention_heads={heads} ({arch.model_type}): the all-to-all "
                f"gives each sp rank heads/(sp·tp) whole heads; pick backend.sp among {fits}"]
    if kv and kv % sp and sp % kv:
        return [f"backend.sp={sp} and the model's {kv} kv-heads per tp rank ({arch.model_type}): one must divide the "
                f"other (fewer kv-heads than sp are repeated); pick backend.sp among "
                f"{[d for d in fits if kv % d == 0 or d % kv == 0]}"]
    return []
