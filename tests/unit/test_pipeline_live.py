"""The live cost under a pipeline without torchrun: the in-flight meter (saved tensors alive at once over several
forwards), the planner's per-pp-rank figures (forward order, chunks in flight, parameters, states, activations) and
PlanFigures.for_pp_rank."""

from types import SimpleNamespace

import pytest
import torch

from llmtrain.metrics.live import InFlightMeter, PipelineRankFigures, PlanFigures
from llmtrain.plan.pp import (
    PipelineLayout,
    StageActivations,
    in_flight_stages,
    rank_actions,
    rank_params,
    rank_state_bytes,
    stage_head,
)

# ---- the meter -----------------------------------------------------------------------------------------------------


def _forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Saves x (its input, for the weight's gradient) and tanh's output: 2 · x.numel() · 4 bytes; the weight is not
    counted."""
    return torch.tanh(layer(x)).sum()


def test_in_flight_meter_sums_the_forwards_alive_at_once():
    """1F1B-like: two forwards in flight, a backward frees one, a third forward: the peak is two forwards' bytes and
    two chunks; GPipe-like (all three before any backward): three."""
    layer = torch.nn.Linear(8, 8)
    xs = [torch.randn(3, 5, 8) for _ in range(3)]  # (b, W, h)
    one = 2 * 3 * 5 * 8 * 4
    meter = InFlightMeter([layer])
    with meter.watch():
        first, second = _forward(layer, xs[0]), _forward(layer, xs[1])
        assert meter.current == 2 * one
        first.backward()
        assert meter.current == one  # autograd let the first forward's saved tensors go
        third = _forward(layer, xs[2])
        second.backward(), third.backward()
    assert (meter.peak, meter.in_flight, meter.current, meter.shape, meter.tokens) == (2 * one, 2, 0, (3, 5), 45)

    meter = InFlightMeter([layer])
    with meter.watch():
        losses = [_forward(layer, x) for x in xs]
        for loss in losses:
            loss.backward()
    assert (meter.peak, meter.in_flight) == (3 * one, 3)


def test_in_flight_meter_counts_a_shared_storage_once_and_ignores_no_grad():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 4, 8)
    meter = InFlightMeter([layer])
    with meter.watch():
        with torch.no_grad():
            layer(x)  # evaluation: nothing saved, no shape
        y = layer(x)  # saves x
        (y * x).sum().backward()  # saves x again (for y's gradient; x needs none, so y is not saved)
    assert meter.peak == x.numel() * 4 and meter.shape == (2, 4) and meter.tokens == 8


# ---- the planner's per-pp-rank figures -----------------------------------------------------------------------------

FACTS = SimpleNamespace(layers=4, hidden=16, heads=2, kv_heads=2, intermediate=32, block=100, embed=1000, head=1000,
                        tp_params=0, softcapping=False, mlp_width=32)


def _layout(schedule: str, pp: int = 2, virtual: int = 1, microbatches: int = 4) -> PipelineLayout:
    stages = pp * virtual
    per = 4 // stages
    return PipelineLayout(pp, virtual, schedule, microbatches, tuple(range(s * per, (s + 1) * per)
                                                                     for s in range(stages)))


def test_the_actions_and_the_chunks_in_flight():
    """GPipe holds all M, 1F1B P − rank; interleaved (torch's rounds of P micro-batches per local stage) rank 0:
    stage 0 m0 m1, stage 2 m0 m1, stage 0 m2 in flight; rank 1: stage 1 m0 m1, stage 3 m0. zbv (the V: rank 0 holds
    stages 0 and 3) at its bound: every chunk of the step."""
    assert in_flight_stages(_layout("gpipe"), 1) == [1] * 4
    assert [in_flight_stages(_layout("1f1b"), r) for r in range(2)] == [[0, 0], [1]]
    interleaved = _layout("interleaved_1f1b", virtual=2)
    assert [stage for kind, stage in rank_actions(interleaved, 0) if kind == "F"] == [0, 0, 2, 2, 0, 0, 2, 2]
    assert in_flight_stages(interleaved, 0) == [0, 0, 2, 2, 0] and in_flight_stages(interleaved, 1) == [1, 1, 3]
    one_round = rank_actions(_layout("interleaved_1f1b", virtual=2, microbatches=3), 1)
    assert [stage for kind, stage in one_round if kind == "F"] == [1, 1, 1, 3, 3, 3]
    assert in_flight_stages(_layout("zbv", virtual=2), 0) == [0] * 4 + [3] * 4
    for layout in (interleaved, _layout("1f1b"), _layout("gpipe")):  # every chunk kept is let go, stage by stage
        for rank in range(2):
            actions = rank_actions(layout, rank)
            assert sorted(s for k, s in actions if k == "F") == sorted(s for k, s in actions if k == "B")


def test_each_pp_ranks_parameters_and_states():
    """Rank 0: its blocks + the embedding; the last rank: its blocks + final norm (h) + head (tied: a copy of the
    embedding; a reward model's score: h). States: 16 bytes a parameter (fp32, grad, Adam's two), the blocks'
    TP-planned share over tp, all over dp."""
    layout = _layout("1f1b")
    head = stage_head(FACTS, scalar=False)
    assert [rank_params(layout, FACTS, r, head) for r in range(2)] == [2 * 100 + 1000, 2 * 100 + 1000 + 16]
    assert stage_head(SimpleNamespace(**{**vars(FACTS), "head": 0}), False) == 1000 and stage_head(FACTS, True) == 16
    assert rank_params(layout, FACTS, 1, stage_head(FACTS, True)) == 2 * 100 + 16 + 16
    assert rank_state_bytes(layout, FACTS, 1, head=head, dp=2) == 16 * 1216 / 2
    tp_facts = SimpleNamespace(**{**vars(FACTS), "tp_params": 4 * 80})  # 80 of each block's 100 split by the TP plan
    assert rank_state_bytes(layout, tp_facts, 0, head=head, dp=1, tp=2) == 16 * (2 * (20 + 40) + 1000)
    # peft=lora, 40 adapter parameters in the model's 4 blocks: the rank's 1216 base parameters frozen (4 bytes
    # each, fp32), its 2 blocks' 20 adapter parameters trained (16 bytes each), over dp 2
    assert rank_state_bytes(layout, FACTS, 1, head=head, dp=2, lora=40) == (4 * 1216 + 16 * 20) / 2


def test_stage_activations_add_the_head_on_the_last_stage_only_and_sum_the_chunks_in_flight():
    from llmtrain.metrics.cost import gated_activation_bytes_per_layer

    count = StageActivations(FACTS, False, 4, 1, False, lambda rows, seq: 1000.0 * rows * seq)
    block = gated_activation_bytes_per_layer(2, 8, 16, 2, intermediate=32, kv_heads=2, elem=4, scores=False)
    final_norm = 2 * 8 * (3 * 16 + 1) * 4
    layout = _layout("1f1b")
    assert count.chunk(layout, 0, 2, 8) == pytest.approx(2 * block)
    assert count.chunk(layout, 1, 2, 8) == pytest.approx(2 * block + final_norm + 16_000)
    assert count.rank(layout, 0, 2, 8) == pytest.approx(2 * 2 * block)  # 1F1B: P − 0 = 2 chunks
    assert count.rank(_layout("gpipe"), 1, 2, 8) == pytest.approx(4 * (2 * block + final_norm + 16_000))
    checkpointed = StageActivations(FACTS, True, 4, 1, False, lambda rows, seq: 0.0)
    block_input = 2 * 8 * 16 * 4
    assert checkpointed.rank(layout, 0, 2, 8) == pytest.approx(2 * 2 * block_input + block)  # + one recompute


def test_plan_figures_for_a_pp_rank():
    ranks = tuple(PipelineRankFigures(float(r + 1), lambda rows, seq, r=r: r * rows * seq, 2 - r) for r in range(2))
    whole = PlanFigures(state_bytes=9.0, gathered_bytes=1.0, activations=lambda rows, seq: 0, flops_per_token=1.0,
                        hardware_flops_per_token=1.0, peak_flops=None, comm={}, pipeline=ranks)
    mine = whole.for_pp_rank(1)
    assert (mine.state_bytes, mine.activations(2, 3), mine.pipeline, mine.gathered_bytes) == (2.0, 6, (ranks[1],), 1.0)
