"""What the live cost (metrics/live.py) compares a run with: `plan_figures`, the planner's row for this run's backend,
world and device, and the pipeline's per-pp-rank figures; and `RunPlan`, the planner's view of one run."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.metrics.comm import planned
from llmtrain.metrics.cost import Collective, Layout, activation_bytes
from llmtrain.metrics.devices import Gpu
from llmtrain.metrics.flops import training_flops_per_token
from llmtrain.metrics.live import PipelineRankFigures, PlanFigures
from llmtrain.plan.core import Row, head_bytes, vocab_split
from llmtrain.plan.pp import StageActivations, in_flight_stages, rank_state_bytes, stage_head
from llmtrain.plan.setting import Setting


@dataclass(frozen=True)
class RunPlan:
    """The planner's view of one run, computed once: the dry-run text, the figures the live cost compares with, and
    what the fit check reads (its setting, its backend's row, the device: plan.fit.run_fit_problems)."""
    text: str
    figures: PlanFigures
    setting: Setting | None = None
    row: Row | None = None
    gpu: Gpu | None = None


def stage_activations(st: Setting, layout: Layout) -> StageActivations:
    """The pipeline's per-stage activation count for this setting on this layout (tp splits the blocks)."""
    return StageActivations(st.facts, st.checkpointing, 2 if st.precision in ("bf16", "fp16") else 4, layout.tp,
                            st.scores, lambda rows, seq: head_bytes(st, rows, seq, vocab_split(st, layout))[0],
                            st.concat_outputs)


def pipelined_head(st: Setting) -> int:
    """The last stage's head parameters for the role the pipeline runs (pipeline_checks: the one trainable role)."""
    role = next((name for name, trainable in st.roles.items() if trainable), None)
    return stage_head(st.facts, role in st.scalar_heads)


def pipeline_figures(st: Setting, layout: Layout, pipeline, dp: int) -> tuple[PipelineRankFigures, ...]:
    """Per pp rank, what the live cost compares with: its model states and activations in flight (() without pp)."""
    if pipeline is None:
        return ()
    count = stage_activations(st, layout)

    def activations(rank: int):
        return lambda rows, seq: count.rank(pipeline, rank, rows, seq)

    head = pipelined_head(st)
    return tuple(PipelineRankFigures(rank_state_bytes(pipeline, st.facts, rank, head=head, dp=dp, tp=layout.tp,
                                                      lora=st.lora),
                                     activations(rank),
                                     len(in_flight_stages(pipeline, rank))) for rank in range(pipeline.pp))


def plan_figures(st: Setting, row: Row, gpu: Gpu, precision: str, p2p: list[Collective] = (),
                 pipeline: tuple[PipelineRankFigures, ...] = ()) -> PlanFigures:
    """The planner's row for this run's backend, world and device, as the live cost compares with it (p2p: the
    pipeline's sends, plan.pp.pipeline_p2p; pipeline: its per-pp-rank figures)."""
    facts, elem = st.facts, 2 if precision in ("bf16", "fp16") else 4

    def activations(rows: int, seq: int) -> float:
        """One forward of one role (the meter's peak is one forward; the planner's table adds every trainable role,
        as if all were alive at once)."""
        return (activation_bytes(rows, seq, facts.hidden, facts.heads, facts.layers, checkpointing=st.checkpointing,
                                 elem=elem, scores=st.scores, intermediate=facts.mlp_width, kv_heads=facts.kv_heads,
                                 softcapping=facts.softcapping, concat_outputs=st.concat_outputs)
                + head_bytes(st, rows, seq, vocab_split(st, row.layout))[0])

    # a rank's share of one token's FLOPs: its tp peers and pp stages compute the same tokens (dp and sp peers split
    # the tokens instead, which the meter counts), so its tokens × the whole model's FLOPs would count them tp·pp times
    peers = row.layout.tp * max(1, len(pipeline))
    model = training_flops_per_token(facts.params, facts.layers, facts.hidden, st.seq) / peers
    recompute = (2 * facts.layers * facts.block + 4 * facts.layers * facts.hidden * st.seq) / peers \
        if st.checkpointing else 0
    # a CPU has no honest peak: MFU only where plan.peak_tflops says one (resolve_gpu gives none for a CPU)
    return PlanFigures(state_bytes=sum(s.device - s.gathered for s in row.states.values()),
                       gathered_bytes=sum(s.gathered for s in row.states.values()), activations=activations,
                       flops_per_token=model, hardware_flops_per_token=model + recompute,
                       peak_flops=gpu.peak_tflops * 1e12 if gpu.peak_tflops else None,
                       comm=planned([*row.comm, *p2p]), pipeline=pipeline,
                       step_s=row.times["step_s"] if row.times else None)
