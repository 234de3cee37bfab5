"""The planner's pipeline column (backend.pp > 1): per pp rank its stages, model states, activations in flight and the
bytes it sends point to point in a step, and the schedule's bubble.

The formulas (the seeds' pages on GPipe and 1F1B; torch's schedules):
- bubble: a step of M micro-batches over P stages idles (P−1) slots of M+P−1 on every rank: (P−1)/(M+P−1); with v
  virtual stages per rank each slot is 1/v as long: (P−1)/(v·M+P−1). The zero-bubble schedules (zb, zbv) fill those
  slots with weight-gradient passes: ≈ 0 in theory when a forward, an input-backward and a weight-backward take equal
  time; the planner prints the interleaved formula for them too, labelled as the bound it is.
- activations in flight on pp rank r: GPipe runs every forward first (M micro-batches); 1F1B starts a backward once
  the pipe is full (P−r); interleaved keeps torch's warm-up, (v−1)·P + 2·(P−1−r) + 1 chunks, at most v·M; zb's
  warm-up grows by 1 (not 2) per hop from the last rank, (v−1)·P + (P−1−r) + 1; zbv runs 2(P−r)−1 + 2r + 1 = 2P
  forwards before its first input-backward, at most 2M.
- p2p: every stage boundary carries each micro-batch's hidden states forward and their gradient backward,
  b·s·h elements each (b: the micro-batch's rows, 2 per pair for the pair stages). A rank sends forward from every
  stage but the last and backward from every stage but the first, except to a stage on its own rank (zbv's V: stages
  P−1 and P both on rank P−1). The live cost counts what the schedules hand to
  isend (metrics/comm.py) next to `pipeline_p2p`, the busiest pp rank's figure (the micro-batch index, b int64s, also
  travels forward: not in the plan, b·s·h·elem / (8·b) = s·h·elem/8 times smaller).
- model states: the rank's parameters (its blocks, the embedding on stage 0, norm and head on the last), fp32 with
  their gradient and Adam's two moments, sharded over dp by FSDP2: 16·params/dp bytes.
"""

from __future__ import annotations

from typing import Any

from llmtrain.backends.pipeline_checks import (
    SCHEDULES,
    StageCosts,
    describe_stage,
    rank_stages,
    split_blocks,
    stage_ranks,
)
from llmtrain.backends.spec import pp_of
from llmtrain.metrics.cost import Collective, activation_bytes

GIB = 1024**3


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of a step on every rank: (P−1)/(v·M + P−1)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, virtual: int) -> int:
    """Micro-batch chunks whose activations pp rank `rank` holds at its peak."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, pp - rank)
    if schedule == "zbv":
        return min(2 * microbatches, 2 * pp)
    per_hop = 1 if schedule == "zb" else 2
    return min(virtual * microbatches, (virtual - 1) * pp + per_hop * (pp - 1 - rank) + 1)


def p2p_sends(pp: int, virtual: int, microbatches: int, v_shape: bool = False) -> list[int]:
    """Per pp rank: the boundary tensors (a micro-batch's hidden states or their gradient) it sends in one step (none
    to a neighbouring stage on its own rank)."""
    stages = pp * virtual

    def remote(s: int, rank: int) -> bool:
        return 0 <= s < stages and stage_ranks(s, pp, v_shape) != rank

    return [sum(remote(s + 1, rank) + remote(s - 1, rank) for s in rank_stages(rank, pp, stages, v_shape)) *
            microbatches for rank in range(pp)]


def bubble_line(schedule: str, pp: int, microbatches: int, virtual: int) -> str:
    """The schedule's idle share as the planner states it, named as the formula it is."""
    formula = f"(P−1)/({'v·' if virtual > 1 else ''}M+P−1) = {bubble_fraction(pp, microbatches, virtual):.1%}"
    if SCHEDULES[schedule].split_backward:
        return (f"bubble ≈ 0 in theory (zero-bubble: weight-gradient passes fill the idle slots when F, B and W take "
                f"equal time), at most interleaved 1F1B's {formula} of each step")
    return f"bubble {formula} of each step"


def boundary_bytes(rows: int, seq: int, hidden: int, precision: str) -> int:
    """One micro-batch's hidden states (b, s, h) at a stage boundary, or their gradient."""
    return rows * seq * hidden * (2 if precision in ("bf16", "fp16") else 4)


def pipeline_p2p(backend: Any, *, rows: int, accum: int, seq: int, hidden: int, precision: str) -> list[Collective]:
    """The busiest pp rank's point-to-point sends of one step, as a Collective of kind p2p ([] without pp)."""
    pp = pp_of(backend)
    if pp <= 1 or backend.pp_schedule not in SCHEDULES:
        return []
    schedule = SCHEDULES[backend.pp_schedule]
    v = backend.pp_virtual_stages if schedule.multi else 1
    return [Collective("PP hidden states forward, their gradients back (busiest pp rank)", "p2p",
                       boundary_bytes(rows, seq, hidden, precision), 2,
                       max(p2p_sends(pp, v, accum, schedule.v_shape)), overlapped=False)]


def pipeline_lines(backend: Any, facts: Any, *, micro: int, accum: int, seq: int, dp: int, precision: str,
                   checkpointing: bool) -> list[str]:
    """The planner's lines for backend.pp > 1 (empty otherwise)."""
    pp = pp_of(backend)
    if pp <= 1 or backend.pp_schedule not in SCHEDULES:
        return []
    schedule = backend.pp_schedule
    v = backend.pp_virtual_stages if SCHEDULES[schedule].multi else 1
    v_shape = SCHEDULES[schedule].v_shape
    stages, f = pp * v, facts
    if f.layers < stages:
        return []
    bounds = split_blocks(f.layers, stages, StageCosts.of(f.block, f.hidden, f.vocab, seq, f.head or f.embed))
    elem = 2 if precision in ("bf16", "fp16") else 4
    sends = p2p_sends(pp, v, accum, v_shape)
    block_act = activation_bytes(micro, seq, f.hidden, f.heads, 1, checkpointing=checkpointing, elem=elem,
                                 scores=False, intermediate=f.intermediate, kv_heads=f.kv_heads)  # one block, b rows
    boundary = boundary_bytes(micro, seq, f.hidden, precision)
    lines = [f"pipeline: pp {pp} × v {v} = {stages} stages, {schedule}, M = {accum} micro-batches of {micro} rows: "
             f"{bubble_line(schedule, pp, accum, v)}; the table above counts every block on every rank, the lines "
             "below each rank's stages"]
    for rank in range(pp):
        mine = rank_stages(rank, pp, stages, v_shape)
        blocks = sum(len(bounds[s]) for s in mine)
        params = blocks * f.block + (f.embed if 0 in mine else 0) + \
            ((f.head or 0) + f.hidden if stages - 1 in mine else 0)
        chunks = in_flight(schedule, pp, rank, accum, v)
        activations = chunks * block_act * blocks / len(mine)
        pieces = "; ".join(f"stage {s}: {describe_stage(s, stages, bounds[s])}" for s in mine)
        lines.append(f"pp rank {rank}: {pieces}: {params / 1e6:,.1f}M parameters, model states "
                     f"{16 * params / dp / GIB:.3g} GiB (fp32 + Adam, /dp {dp}), activations {chunks} micro-batch "
                     f"chunk(s) in flight ≈ {activations / GIB:.3g} GiB, p2p {sends[rank] * boundary / 1e9:.3g} GB "
                     "sent per step")
    return lines
