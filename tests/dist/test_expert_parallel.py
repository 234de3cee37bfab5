"""Expert parallelism (models/expert_parallel.py) under torchrun, gloo, 2 CPU ranks, fp32: one launch of
tests/dist/workers/expert_parallel_checks.py, every family and layout in it.

Mixtral, Qwen3-MoE and Qwen2-MoE (shared expert), tiny and from config, each with its experts over ep = 2 beside
tp = 1 (dp 2: each rank its own rows, the experts' tokens exchanged all-to-all) and beside tp = 2 (ep = tp, dp 1: the
tp peers share the rows, each dispatches half), FSDP-sharded as the lead's wiring will (experts on efsdp with their
gradient scale, blocks on dp), against the same weights whole on one process, every dp rank's rows through it. The
worker takes any world size: `torchrun --nproc_per_node 4` runs ep 2 × efsdp 2 (same bounds, measured).
"""

from __future__ import annotations

import pytest

from tests.helpers import run_worker

pytestmark = pytest.mark.dist

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")


def _launch(out, ranks: int) -> list[dict]:
    return run_worker("tests.dist.workers.expert_parallel_checks", out, ranks=ranks)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return _launch(tmp_path_factory.mktemp("expert_parallel"), 2)


def test_ep2_times_efsdp2_on_4_ranks_equals_one_process(tmp_path):
    """4 ranks, ep 2 beside tp 1: dp 4, each pair of ranks holding the same 2 experts FSDP-shards them (efsdp 2, their
    gradients summed over it and divided by dp): outputs bit for bit, every gradient within 1e-6 relative, each
    rank's expert rows its own shard (1 of its ep group's 2 experts), the gathered full state the model's."""
    for report in _launch(tmp_path, 4):
        for family in FAMILIES:
            case = report[f"{family}_ep2_tp1"]
            assert (case["dp"], case["efsdp"], case["expert_local_rows"]) == (4, 2, 1), case
            assert case["logits_max_abs"] == 0 and case["loss_rel"] == 0 and case["load_equal"], case
            assert case["dense_grad_max_rel"] <= 1e-6 and case["expert_grad_max_rel"] <= 1e-6, case
            assert case["full_state_equal"], case


@pytest.mark.parametrize("ep_family", FAMILIES)
def test_ep2_beside_tp1_equals_one_process(reports, ep_family):
    """ep 2 = dp 2 (efsdp 1): outputs, router logits, the router's aux loss and busiest-expert load bit for bit (routing
    is per token: the router runs on this rank's rows as in a DDP run); every gradient within 1e-6 relative, the dense
    ones bit for bit; each rank's own gradient shard is its two experts' slice of the whole gradient (the all-to-all's
    backward brings the other rank's tokens' share; without the divide-by-dp scale the experts' are off by 100 %)."""
    for report in reports:
        case = report[f"{ep_family}_ep2_tp1"]
        assert (case["dp"], case["efsdp"], case["expert_local_rows"]) == (2, 1, 2)
        assert case["logits_max_abs"] == 0 and case["router_logits_max_abs"] == 0 and case["loss_rel"] == 0, case
        assert case["aux_equal"] and case["load_equal"], case
        assert case["dense_grad_max_rel"] == 0 and case["expert_grad_max_rel"] <= 1e-6, case
        assert case["expert_slice_max_abs"] <= 1e-8, case
        assert case["full_state_equal"], case


@pytest.mark.parametrize("ep_family", FAMILIES)
def test_ep2_equal_to_tp2_matches_one_process(reports, ep_family):
    """ep = tp = 2 (dp 1): attention split by tp, experts by ep (left out of the tp plan), each tp peer dispatching
    half of the shared rows: outputs and router logits within 1e-6, loss 1e-6 relative, the busiest-expert load equal,
    every gradient within 1e-5 relative (tp's sums change the rounding), the gathered full state the model's."""
    for report in reports:
        case = report[f"{ep_family}_ep2_tp2"]
        assert (case["dp"], case["efsdp"], case["expert_local_rows"]) == (1, 1, 2)
        assert case["logits_max_abs"] <= 1e-6 and case["router_logits_max_abs"] <= 1e-6, case
        assert case["loss_rel"] <= 1e-6 and case["load_equal"], case
        assert case["dense_grad_max_rel"] <= 1e-5 and case["expert_grad_max_rel"] <= 1e-5, case
        assert case["expert_slice_max_abs"] <= 1e-8 and case["full_state_equal"], case


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_all_to_all_bytes_are_counted_as_planned(reports, layout):
    """The live meter (metrics/comm.py) counts every all-to-all of the dispatch, forward and backward: rows out are
    exactly tokens/tp · k per rank, rows back depend on the routing, so the ranks' sum equals the planned figure
    (`all_to_all_bytes`) times the ranks exactly. transformers' AllToAllEP, on functional collectives, shows 0."""
    for family in FAMILIES:
        cases = [r[f"{family}_ep2_{layout}"] for r in reports]
        assert all(c["all_to_all_payload"] > 0 for c in cases), cases
        assert sum(c["all_to_all_payload"] for c in cases) == 2 * cases[0]["all_to_all_planned"], cases
    assert all(r["transformers_all_to_all"]["all_to_all_payload"] == 0 for r in reports)


def test_a_rank_whose_experts_get_no_token_still_matches(reports):
    """Every token routed to one rank's experts (zero router weights: tied logits): the other rank runs its experts on
    an empty slice, so its exchange and its experts' FSDP reduction still run (else a hang), and it sends only its rows
    out and their returned gradients. Outputs, router terms and gradients as in the balanced case; the idle experts'
    gradients zero."""
    cases = [r["mixtral_skewed"] for r in reports]
    for case in cases:
        assert case["logits_max_abs"] == 0 and case["aux_equal"] and case["load_equal"], case
        assert case["dense_grad_max_rel"] == 0 and case["expert_grad_max_rel"] <= 1e-6, case
    payloads, planned = sorted(c["all_to_all_payload"] for c in cases), cases[0]["all_to_all_planned"]
    counts = 2 * 8 * 4  # 2 MoE layers × 4 experts' int64 counts
    assert payloads[0] == (planned + counts) // 2 and sum(payloads) == 2 * planned, payloads
