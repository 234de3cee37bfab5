"""Ulysses sequence parallelism (`backend.sp`, models/ulysses.py): sp peers share one sequence, s/sp tokens each, and
exchange all of it in each attention's all-to-alls (4 per layer): more traffic than dp's once-a-step gradients, less
than tp's, so it sits between cp and tp in the mesh. sp peers hold the same weights (fully_shard folds them into
dp_shard: ParallelDims' row views) and read the same examples. The attention wrapper itself is applied where attention
is resolved (models/attention.py, sequence_parallel.py)."""

from __future__ import annotations

from typing import Any

from llmtrain.parallel.dimension import Dimension, register


def arch_problems(backend: Any, dims: Any, arch: Any) -> list[str]:
    from llmtrain.models.ulysses_checks import sp_model_problems

    return sp_model_problems(dims.sp, dims.tp, arch)


def facts_problems(backend: Any, dims: Any, facts: Any) -> list[str]:
    from llmtrain.models.ulysses_checks import sp_facts_problems

    return sp_facts_problems(dims.sp, dims.tp, facts)


def collectives(layout: Any, facts: Any, precision: str, *, tokens_per_micro: int, accum: int, trainable: bool,
                checkpointing: bool) -> list:
    """4 all-to-alls per layer and forward (q, k, v in; the output back), of this rank's s/sp tokens: q and the output
    h/tp wide, k and v kv_hidden/tp (kv-heads fewer than sp are repeated up to sp); the same again in backward, and in
    the recompute of a checkpointed block."""
    from llmtrain.metrics.cost import Collective, elem_bytes

    head_dim = facts.hidden // facts.heads
    kv_width = max(facts.kv_heads // layout.tp, layout.sp) * head_dim
    payload = elem_bytes(precision) * tokens_per_micro * (2 * facts.hidden / layout.tp + 2 * kv_width)
    passes = 1 + (1 if trainable else 0) + (1 if trainable and checkpointing else 0)
    return [Collective("SP all-to-all (q, k, v, output)", "all_to_all", payload, layout.sp,
                       passes * facts.layers * accum, overlapped=False)]


def plan_line(st: Any, row: Any) -> str:
    lay = row.layout
    return (f"{lay.name}: dp {lay.dp} × sp {lay.sp}, {-(-st.seq // lay.row_split)} tokens of each row per rank "
            "(activations and logits at that share; 4 all-to-alls per layer)")


SP = register(Dimension(name="sp", position=30, same_data=True, shares_rows=True,
                        arch_problems=arch_problems, facts_problems=facts_problems,
                        collectives=collectives, plan_line=plan_line))
