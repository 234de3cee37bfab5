"""What `backend.sp > 1` (Ulysses sequence parallelism, models/ulysses.py) needs of a model's architecture, checked
before any weights load (the backends' model_problems; the config's own checks: llmtrain/sequence_parallel.py).
Each line names the field and the fix."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def sp_facts_problems(sp: int, tp: int, facts: Any) -> list[str]:
    """sp_model_problems on the planner's model facts (models/facts.ModelFacts: no transformers config at hand)."""
    arch = SimpleNamespace(num_attention_heads=facts.heads, num_key_value_heads=facts.kv_heads,
                           model_type=facts.model_type)
    return sp_model_problems(sp, tp, arch)


def _has_routers(arch: Any) -> bool:
    from transformers import PretrainedConfig

    from llmtrain.models.moe import router_of

    return isinstance(arch, PretrainedConfig) and router_of(SimpleNamespace(config=arch)) is not None


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
    if _has_routers(arch):
        return [f"backend.sp={sp} with an MoE model ({arch.model_type}): the routers' aux loss is a statistic of the "
                "tokens one forward sees, and an sp rank sees s/sp of each row (the loss would differ from sp=1's); "
                "set backend.sp=1"]
    if kv and kv % sp and sp % kv:
        return [f"backend.sp={sp} and the model's {kv} kv-heads per tp rank ({arch.model_type}): one must divide the "
                f"other (fewer kv-heads than sp are repeated); pick backend.sp among "
                f"{[d for d in fits if kv % d == 0 or d % kv == 0]}"]
    return []
