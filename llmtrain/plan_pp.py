"""The planner's pipeline column (backend.pp > 1): per pp rank its stages, model states, activations in flight and the
bytes it sends point to point in a step, and the schedule's bubble.

The formulas (the seeds' pages on GPipe and 1F1B; torch's schedules):
- bubble: a step of M micro-batches over P stages idles (P−1) slots of M+P−1 on every rank: (P−1)/(M+P−1); with v
  virtual stages per rank each slot is 1/v as long: (P−1)/(v·M+P−1).
- activations in flight on pp rank r: GPipe runs every forward first (M micro-batches); 1F1B starts a backward once
  the pipe is full (P−r); interleaved keeps torch's warm-up, (v−1)·P + 2·(P−1−r) + 1 chunks, at most v·M.
- p2p: every stage boundary carries each micro-batch's hidden states forward and their gradient backward,
  b·s·h elements each (b: the micro-batch's rows, 2 per pair for the pair stages). A rank sends forward from every
  stage but the last and backward from every stage but the first. The live cost counts what the schedules hand to
  isend (metrics/comm.py) next to `pipeline_p2p`, the busiest pp rank's figure (the micro-batch index, b int64s, also
  travels forward: not in the plan, b·s·h·elem / (8·b) = s·h·elem/8 times smaller).
- model states: the rank's parameters (its blocks, the embedding on stage 0, norm and head on the last; a tied head is
  a copy of the embedding there, a reward model's score (1, h)), fp32 with their gradient and Adam's two moments,
  the blocks' TP-planned share over tp, sharded over dp by FSDP2: 16·params/dp bytes.
- activations at the peak (`rank_activation_bytes`, what the live cost measures: metrics/live.InFlightMeter): the
  bytes autograd keeps for backward summed over the micro-batch chunks in flight at once, each chunk its stage's
  bytes (its blocks; the last stage adds the final norm and the head's held bytes); the chunks in flight are the first
  `in_flight` forwards of the rank's order (interleaved: rounds of micro-batches per local stage, torch's order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmtrain.backends.pipeline_checks import SCHEDULES, StageCosts, describe_stage, split_blocks
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
    return min(virtual * microbatches, (virtual - 1) * pp + 2 * (pp - 1 - rank) + 1)


def p2p_sends(pp: int, virtual: int, microbatches: int) -> list[int]:
    """Per pp rank: the boundary tensors (a micro-batch's hidden states or their gradient) it sends in one step."""
    stages = pp * virtual
    return [sum((s != stages - 1) + (s != 0) for s in range(rank, stages, pp)) * microbatches for rank in range(pp)]


def boundary_bytes(rows: int, seq: int, hidden: int, precision: str) -> int:
    """One micro-batch's hidden states (b, s, h) at a stage boundary, or their gradient."""
    return rows * seq * hidden * (2 if precision in ("bf16", "fp16") else 4)


def pipeline_p2p(backend: Any, *, rows: int, accum: int, seq: int, hidden: int, precision: str) -> list[Collective]:
    """The busiest pp rank's point-to-point sends of one step, as a Collective of kind p2p ([] without pp)."""
    pp = pp_of(backend)
    if pp <= 1 or backend.pp_schedule not in SCHEDULES:
        return []
    v = backend.pp_virtual_stages if SCHEDULES[backend.pp_schedule][1] else 1
    return [Collective("PP hidden states forward, their gradients back (busiest pp rank)", "p2p",
                       boundary_bytes(rows, seq, hidden, precision), 2, max(p2p_sends(pp, v, accum)), overlapped=False)]


@dataclass(frozen=True)
class PipelineLayout:
    """Which stages run where: P pp ranks × v stages each, stage s on pp rank s mod P, its blocks bounds[s]."""
    pp: int
    virtual: int
    schedule: str
    microbatches: int  # M: trainer.grad_accum_steps
    bounds: tuple[range, ...]  # per stage, the decoder blocks it runs

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.stages, self.pp))


def pipeline_layout(backend: Any, facts: Any, *, accum: int, seq: int) -> PipelineLayout | None:
    """The run's stages as backends/pipeline.build_parts splits them (None without pp, or with too few blocks)."""
    pp = pp_of(backend)
    if pp <= 1 or backend.pp_schedule not in SCHEDULES:
        return None
    v = backend.pp_virtual_stages if SCHEDULES[backend.pp_schedule][1] else 1
    if facts.layers < pp * v:
        return None
    costs = StageCosts.of(facts.block, facts.hidden, facts.vocab, seq, facts.head or facts.embed)
    return PipelineLayout(pp, v, backend.pp_schedule, accum, tuple(split_blocks(facts.layers, pp * v, costs)))


def rank_params(layout: PipelineLayout, facts: Any, rank: int, head: int) -> int:
    """Parameters pp rank `rank` holds: its blocks, the embedding on stage 0, final norm and `head` on the last (the LM
    head; a tied one is its own copy of the embedding there, backends/pipeline_engine sums the two copies' gradients;
    a reward model's score is (1, h): `stage_head`)."""
    mine = layout.stages_of(rank)
    blocks = sum(len(layout.bounds[s]) for s in mine)
    last = layout.stages - 1 in mine
    return blocks * facts.block + (facts.embed if 0 in mine else 0) + (head + facts.hidden if last else 0)


def stage_head(facts: Any, scalar: bool) -> int:
    """The last stage's head parameters: a scalar score (1, h), or the LM head (tied: a copy of the embedding)."""
    return facts.hidden if scalar else facts.head or facts.embed


def rank_state_bytes(layout: PipelineLayout, facts: Any, rank: int, *, head: int, dp: int, tp: int = 1) -> float:
    """Model states of pp rank `rank`: fp32 weights, gradients and Adam's two moments (16 bytes a parameter), the
    blocks' TP-planned share split over tp (the head stays whole under pp), all of it FSDP2-sharded over dp."""
    blocks = sum(len(layout.bounds[s]) for s in layout.stages_of(rank))
    split = blocks * facts.tp_params / facts.layers * (1 - 1 / tp)
    return 16 * (rank_params(layout, facts, rank, head) - split) / dp


def forward_order(layout: PipelineLayout, rank: int) -> list[int]:
    """The stage of each forward pp rank `rank` runs in a step, in order: M forwards of its one stage, or (interleaved)
    rounds of M // max(1, M // P) micro-batches through each of its v stages in turn (torch's
    ScheduleInterleaved1F1B)."""
    mine, m = layout.stages_of(rank), layout.microbatches
    if layout.virtual == 1:
        return [mine[0]] * m
    per_round = m // max(1, m // layout.pp)
    return [mine[(k // per_round) % layout.virtual] for k in range(layout.virtual * m)]


def in_flight_stages(layout: PipelineLayout, rank: int) -> list[int]:
    """The stage of each micro-batch chunk whose activations pp rank `rank` holds at its peak (`in_flight` of them:
    the first forwards of its order, run before its first backward)."""
    chunks = in_flight(layout.schedule, layout.pp, rank, layout.microbatches, layout.virtual)
    return forward_order(layout, rank)[:chunks]


def rank_activation_bytes(layout: PipelineLayout, rank: int, chunk_bytes: Callable[[int], float]) -> float:
    """Bytes kept for backward at pp rank `rank`'s peak: `chunk_bytes(stage)` (one micro-batch through that stage)
    summed over the chunks in flight at once."""
    return sum(chunk_bytes(stage) for stage in in_flight_stages(layout, rank))


def pipeline_lines(backend: Any, facts: Any, *, micro: int, accum: int, seq: int, dp: int, tp: int, head: int,
                   precision: str, rank_activations: Callable[[int], float]) -> list[str]:
    """The planner's lines for backend.pp > 1 (empty otherwise); rank_activations(rank): that rank's activations at
    its peak at the plan's micro-batch shape (plan.pipeline_activations: the figure the live cost compares with)."""
    layout = pipeline_layout(backend, facts, accum=accum, seq=seq)
    if layout is None:
        return []
    pp, v, stages, bounds = layout.pp, layout.virtual, layout.stages, layout.bounds
    sends = p2p_sends(pp, v, accum)
    boundary = boundary_bytes(micro, seq, facts.hidden, precision)
    lines = [f"pipeline: pp {pp} × v {v} = {stages} stages, {layout.schedule}, M = {accum} micro-batches of {micro} "
             f"rows: bubble (P−1)/({'v·' if v > 1 else ''}M+P−1) = {bubble_fraction(pp, accum, v):.1%} of each step; "
             "the table above counts every block on every rank, the lines below each rank's stages"]
    for rank in range(pp):
        pieces = "; ".join(f"stage {s}: {describe_stage(s, stages, bounds[s])}" for s in layout.stages_of(rank))
        chunks = len(in_flight_stages(layout, rank))
        activations = rank_activations(rank)
        states = rank_state_bytes(layout, facts, rank, head=head, dp=dp, tp=tp)
        lines.append(f"pp rank {rank}: {pieces}: {rank_params(layout, facts, rank, head) / 1e6:,.1f}M parameters, "
                     f"model states {states / GIB:.3g} GiB (fp32 + Adam, {f'blocks /tp {tp}, ' if tp > 1 else ''}"
                     f"/dp {dp}), "
                     f"activations {chunks} micro-batch chunk(s) in flight ≈ {activations / GIB:.3g} GiB, p2p "
                     f"{sends[rank] * boundary / 1e9:.3g} GB sent per step")
    return lines


@dataclass(frozen=True)
class StageActivations:
    """Bytes one micro-batch keeps for backward through one stage (metrics/cost.activation_bytes' count, split by
    stage), and a rank's sum at its peak: what metrics/live.InFlightMeter measures."""
    facts: Any
    checkpointing: bool
    elem: int
    tp: int
    scores: bool
    head_held: Callable[[int, int], float]  # (rows, seq) -> the head's bytes held to backward (plan.head_bytes' first)

    def _all_blocks(self, rows: int, seq: int, blocks: int, checkpointing: bool) -> float:
        f = self.facts
        return activation_bytes(rows, seq, f.hidden, f.heads, blocks, checkpointing=checkpointing, tp=self.tp,
                                elem=self.elem, scores=self.scores, intermediate=f.intermediate, kv_heads=f.kv_heads,
                                softcapping=f.softcapping)

    def chunk(self, layout: PipelineLayout, stage: int, rows: int, seq: int) -> float:
        """One micro-batch through `stage`: its blocks (their inputs only, under checkpointing), and on the last stage
        what activation_bytes counts outside the blocks (the final norm) and the head's held bytes."""
        blocks = len(layout.bounds[stage])
        kept = self._all_blocks(rows, seq, blocks, self.checkpointing) - self._all_blocks(rows, seq, 0,
                                                                                          self.checkpointing)
        if stage != layout.stages - 1:
            return kept
        return kept + self._all_blocks(rows, seq, 0, False) + self.head_held(rows, seq)

    def rank(self, layout: PipelineLayout, rank: int, rows: int, seq: int) -> float:
        """pp rank `rank` at its peak: its chunks in flight, plus (checkpointing) one block's recompute at a time."""
        recompute = self._all_blocks(rows, seq, 0, True) - self._all_blocks(rows, seq, 0, False) \
            if self.checkpointing else 0.0
        return rank_activation_bytes(layout, rank, lambda stage: self.chunk(layout, stage, rows, seq)) + recompute
