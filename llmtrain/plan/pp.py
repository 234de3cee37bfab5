"""The planner's pipeline column (backend.pp > 1): per pp rank its stages, model states, activations in flight and the
bytes it sends point to point in a step, and the schedule's bubble.

The formulas (the seeds' pages on GPipe and 1F1B; torch's schedules):
- bubble: a step of M micro-batches over P stages idles (P−1) slots of M+P−1 on every rank: (P−1)/(M+P−1); with v
  virtual stages per rank each slot is 1/v as long: (P−1)/(v·M+P−1). The zero-bubble schedules (zb, zbv) fill those
  slots with weight-gradient passes: ≈ 0 in theory when a forward, an input-backward and a weight-backward take equal
  time; the planner prints the interleaved formula for them too, labelled as the bound it is.
- activations in flight on pp rank r: the most micro-batch chunks alive at once over the rank's actions in torch's
  order (`rank_actions`): GPipe runs every forward first (M); 1F1B starts a backward once the pipe is full (P−r);
  interleaved keeps torch's warm-up, (v−1)·M/rounds + 2·(P−1−r) forwards, plus the one before the first backward.
  The zero-bubble schedules (zb, zbv) are planned at their bound, all v·M chunks: torch's split backward keeps part of
  each chunk's graph past its weight pass (measured below the bound, `in_flight_stages`).
- p2p: every stage boundary carries each micro-batch's hidden states forward and their gradient backward,
  b·s·h elements each (b: the micro-batch's rows, 2 per pair for the pair stages). A rank sends forward from every
  stage but the last and backward from every stage but the first, except to a stage on its own rank (zbv's V: stages
  P−1 and P both on rank P−1). The live cost counts what the schedules hand to
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

from llmtrain.backends.pipeline_checks import (
    SCHEDULES,
    StageCosts,
    describe_stage,
    rank_stages,
    split_blocks,
    stage_ranks,
)
from llmtrain.metrics.cost import Collective, activation_bytes
from llmtrain.parallel import degree_of

GIB = 1024**3


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of a step on every rank: (P−1)/(v·M + P−1)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, virtual: int) -> int:
    """Micro-batch chunks whose activations pp rank `rank` holds at its peak (`in_flight_stages`, counted)."""
    return len(in_flight_stages(PipelineLayout(pp, virtual, schedule, microbatches, ()), rank))


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
    pp = degree_of(backend, "pp")
    if pp <= 1 or backend.pp_schedule not in SCHEDULES:
        return []
    schedule = SCHEDULES[backend.pp_schedule]
    v = backend.pp_virtual_stages if schedule.multi else 1
    return [Collective("PP hidden states forward, their gradients back (busiest pp rank)", "p2p",
                       boundary_bytes(rows, seq, hidden, precision), 2,
                       max(p2p_sends(pp, v, accum, schedule.v_shape)), overlapped=False)]


@dataclass(frozen=True)
class PipelineLayout:
    """Which stages run where: P pp ranks × v stages each, stage s on pp rank s mod P (zbv's V: rank r holds stages r
    and 2P−1−r), its blocks bounds[s]."""
    pp: int
    virtual: int
    schedule: str
    microbatches: int  # M: trainer.grad_accum_steps
    bounds: tuple[range, ...]  # per stage, the decoder blocks it runs

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    @property
    def v_shape(self) -> bool:
        return SCHEDULES[self.schedule].v_shape

    def stages_of(self, rank: int) -> list[int]:
        return rank_stages(rank, self.pp, self.stages, self.v_shape)


def pipeline_layout(backend: Any, facts: Any, *, accum: int, seq: int) -> PipelineLayout | None:
    """The run's stages as backends/pipeline.build_parts splits them (None without pp, or with too few blocks)."""
    pp = degree_of(backend, "pp")
    if pp <= 1 or backend.pp_schedule not in SCHEDULES:
        return None
    v = backend.pp_virtual_stages if SCHEDULES[backend.pp_schedule].multi else 1
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


def rank_state_bytes(layout: PipelineLayout, facts: Any, rank: int, *, head: int, dp: int, tp: int = 1,
                     lora: int = 0) -> float:
    """Model states of pp rank `rank`: fp32 weights, gradients and Adam's two moments (16 bytes a parameter), the
    blocks' TP-planned share split over tp (the head stays whole under pp), all of it FSDP2-sharded over dp.
    `lora`: the model's adapter parameters (peft=lora, all in the blocks, as many in each): the base is frozen (its
    fp32 weights, 4 bytes a parameter) and this rank's blocks' adapters train (16 bytes)."""
    blocks = sum(len(layout.bounds[s]) for s in layout.stages_of(rank))
    split = blocks * facts.tp_params / facts.layers * (1 - 1 / tp)
    held = rank_params(layout, facts, rank, head) - split
    if not lora:
        return 16 * held / dp
    return (4 * held + 16 * blocks * lora / facts.layers) / dp


def rank_actions(layout: PipelineLayout, rank: int) -> list[tuple[str, int]]:
    """What pp rank `rank` does in a step under gpipe, 1f1b and interleaved_1f1b, in torch's order, as far as saved
    activations go: ("F", stage) a forward that keeps one micro-batch chunk for backward; ("B", stage) the backward
    that lets the oldest chunk of that stage go."""
    p, v, m, mine = layout.pp, layout.virtual, layout.microbatches, layout.stages_of(rank)
    per_round = m // max(1, m // p)  # torch's microbatches_per_round
    hop = 2 if layout.schedule == "interleaved_1f1b" else 1
    warmup = m if layout.schedule == "gpipe" else min(v * m, (v - 1) * per_round + hop * (p - 1 - rank))
    actions = []
    for op in range(v * m + warmup):  # torch's _get_1f1b_rank_ops: warm-up F, then F + B, then the cool-down's B
        if op < v * m:
            actions.append(("F", mine[(op // per_round) % v]))
        if op >= warmup:
            actions.append(("B", mine[v - 1 - ((op - warmup) // per_round) % v]))
    return actions


def in_flight_stages(layout: PipelineLayout, rank: int) -> list[int]:
    """The stage of each micro-batch chunk whose activations pp rank `rank` holds at its peak: the most chunks alive at
    once over `rank_actions` (the first time that many are). Under a split backward (zb, zbv) the bound, every chunk
    of the step: torch's input pass keeps the graph's intermediates for the weight pass, and the weight pass does not
    free a chunk's tensors as a backward does (measured on 2 ranks: up to all M chunks alive at once, 51-77 % of the
    bound's bytes)."""
    if SCHEDULES[layout.schedule].split_backward:
        return [stage for stage in layout.stages_of(rank) for _ in range(layout.microbatches)]
    alive: list[int] = []
    peak: list[int] = []
    for kind, stage in rank_actions(layout, rank):
        alive.append(stage) if kind == "F" else alive.remove(stage)
        if len(alive) > len(peak):
            peak = list(alive)
    return peak


def rank_activation_bytes(layout: PipelineLayout, rank: int, chunk_bytes: Callable[[int], float]) -> float:
    """Bytes kept for backward at pp rank `rank`'s peak: `chunk_bytes(stage)` (one micro-batch through that stage)
    summed over the chunks in flight at once."""
    return sum(chunk_bytes(stage) for stage in in_flight_stages(layout, rank))


def pipeline_lines(backend: Any, facts: Any, *, micro: int, accum: int, seq: int, dp: int, tp: int, head: int,
                   precision: str, rank_activations: Callable[[int], float], lora: int = 0) -> list[str]:
    """The planner's lines for backend.pp > 1 (empty otherwise); rank_activations(rank): that rank's activations at
    its peak at the plan's micro-batch shape (plan.pipeline_activations: the figure the live cost compares with);
    lora: the adapter parameters under peft=lora (rank_state_bytes)."""
    layout = pipeline_layout(backend, facts, accum=accum, seq=seq)
    if layout is None:
        return []
    pp, v, stages, bounds = layout.pp, layout.virtual, layout.stages, layout.bounds
    sends = p2p_sends(pp, v, accum, layout.v_shape)
    boundary = boundary_bytes(micro, seq, facts.hidden, precision)
    lines = [f"pipeline: pp {pp} × v {v} = {stages} stages, {layout.schedule}, M = {accum} micro-batches of {micro} "
             f"rows: {bubble_line(layout.schedule, pp, accum, v)}; "
             "the table above counts every block on every rank, the lines below each rank's stages"]
    for rank in range(pp):
        pieces = "; ".join(f"stage {s}: {describe_stage(s, stages, bounds[s])}" for s in layout.stages_of(rank))
        chunks = len(in_flight_stages(layout, rank))
        activations = rank_activations(rank)
        states = rank_state_bytes(layout, facts, rank, head=head, dp=dp, tp=tp, lora=lora)
        held = "frozen fp32 base, adapters + Adam" if lora else "fp32 + Adam"
        lines.append(f"pp rank {rank}: {pieces}: {rank_params(layout, facts, rank, head) / 1e6:,.1f}M parameters, "
                     f"model states {states / GIB:.3g} GiB ({held}, {f'blocks /tp {tp}, ' if tp > 1 else ''}"
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
    concat_outputs: bool = False  # packed rows through per-sample attention (metrics/cost.py)

    def _all_blocks(self, rows: int, seq: int, blocks: int, checkpointing: bool) -> float:
        f = self.facts
        return activation_bytes(rows, seq, f.hidden, f.heads, blocks, checkpointing=checkpointing, tp=self.tp,
                                elem=self.elem, scores=self.scores, intermediate=f.mlp_width, kv_heads=f.kv_heads,
                                softcapping=f.softcapping, concat_outputs=self.concat_outputs)

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
