"""Ulysses sequence parallelism and ring attention under torchrun (gloo, 2 CPU ranks, fp32): backend.sp=2 and
backend.cp=2 equal sp=1 on the same global batch.

Every run loads the same saved tiny model (4 query heads, 2 kv-heads) and trains 6 steps of global batch 16 with
weight decay on, saving at step 3: the sp=1 references are DDP on 2 ranks (micro 4 × accumulation 2 × dp 2); the
sp=2 runs put both ranks on each row (micro 8 × accumulation 2 × dp 1); two 4-rank runs are dp 2 × sp 2 and
sp 2 × tp 2. The cp=2 runs (ring attention, zig-zag chunks) do the same on FSDP2 (packed and not) and ZeRO-2, sp 2 ×
cp 2 on 4 ranks; DPO under cp=2 against DDP; a cp=2 checkpoint resumes bitwise, and at cp=1.
Packed rows (data.packing=true) fill 64-token rows with several samples, so the shard cut at 32 falls inside
samples. The worker (tests/dist/workers/sequence_parallel_checks.py) checks, in one launch, what the runs cannot
show: per-token log-probs and summed gradients of crafted batches (a packed sample split by the cut, odd widths
padded, one kv-head replicated), the pair stages' per-sequence values on shards (reward scores read on the peer that
holds each last token, SimPO's length-averaged log-probs) with their losses and gradients, and that the attention is
registered per run without touching transformers' own functions. The pair stages' runs under sp:
tests/dist/test_preference.py.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, BatchedRuns, read_metrics, run_worker

pytestmark = pytest.mark.dist

EVAL = REPO / "llmtrain" / "assets" / "data" / "reverse_eval.jsonl"
COMMON = ["trainer.max_steps=6", "trainer.grad_accum_steps=2", "optim.weight_decay=0.1",
          "trainer.save_every_n_steps=3", "trainer.keep_last_k=2", "trainer.eval_every_n_steps=6",
          f"data.eval_files=[{EVAL}]", "trainer.eval_batch_size=16"]
SP2 = ["backend.sp=2", "trainer.micro_batch_size=8"]  # dp 1: the same 16 rows a step as dp 2 × micro 4
CP2 = ["backend.cp=2", "trainer.micro_batch_size=8"]
PACKED = ["data.packing=true"]
RUNS = {  # name -> overrides; "ddp*" are the sp=1 references
    "ddp": ["trainer.micro_batch_size=4"],
    "ddp_packed": ["trainer.micro_batch_size=4", *PACKED],
    "zero2_sp2": ["backend=zero2", *SP2, *PACKED],
    "zero3_sp2": ["backend=zero3", *SP2, *PACKED],
    "fsdp2_sp2": ["backend=fsdp2", *SP2, *PACKED],
    "fsdp2_sp2_unpacked": ["backend=fsdp2", *SP2],
    # 4 ranks: dp 2 × sp 2 (micro 4 × accumulation 2 × dp 2), FSDP2 sharding over dp_shard × sp flattened
    "fsdp2_dp2_sp2": ["backend=fsdp2", "backend.sp=2", "trainer.micro_batch_size=4", *PACKED],
    # 4 ranks: sp 2 × tp 2 (dp 1): 2 query heads and 1 kv-head per tp rank, so the kv-head is repeated for sp
    "fsdp2_sp2_tp2": ["backend=fsdp2", "backend.tp=2", *SP2, *PACKED],
    # ring attention (backend.cp=2, zig-zag chunks): packed rows keep their samples apart in every block pair
    "fsdp2_cp2": ["backend=fsdp2", *CP2, *PACKED],
    "fsdp2_cp2_unpacked": ["backend=fsdp2", *CP2],
    "zero2_cp2": ["backend=zero2", *CP2, *PACKED],
    # 4 ranks: sp 2 × cp 2 (dp 1): Ulysses inside each cp rank's chunks, the ring across them; cp 4 (8 chunks of 8
    # tokens); cp 2 × tp 2 (the loss summed over cp peers apart from tp's)
    "fsdp2_sp2_cp2": ["backend=fsdp2", "backend.sp=2", *CP2, *PACKED],
    "fsdp2_cp4": ["backend=fsdp2", "backend.cp=4", "trainer.micro_batch_size=8", *PACKED],
    "fsdp2_cp2_tp2": ["backend=fsdp2", "backend.tp=2", *CP2, *PACKED],
}
NPROC = {"fsdp2_dp2_sp2": 4, "fsdp2_sp2_tp2": 4, "fsdp2_sp2_cp2": 4, "fsdp2_cp4": 4, "fsdp2_cp2_tp2": 4}
SP1 = ["backend.sp=1", "trainer.micro_batch_size=4"]  # dp 2 × micro 4: the same global batch
# resumed from the step-3 checkpoint of a run above: name -> (that run, overrides after its own)
RESUMED = {"zero2_sp2_resumed": ("zero2_sp2", []), "zero2_sp2_as_sp1": ("zero2_sp2", SP1),
           "fsdp2_sp2_as_sp1": ("fsdp2_sp2", SP1), "fsdp2_cp2_resumed": ("fsdp2_cp2", []),
           "fsdp2_cp2_as_sp1": ("fsdp2_cp2", ["backend.cp=1", *SP1])}


# DPO under cp=2 (each pair's per-sequence sums over the ring's shards, each pair counted once) against DDP's; the
# other pair stages and sp: tests/dist/test_preference.py
DPO_CP = {"dpo_ddp": [], "dpo_fsdp2_cp2": ["backend=fsdp2", "backend.cp=2", "trainer.micro_batch_size=4"]}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory, base_args, pair_args) -> BatchedRuns:
    """All the module's runs, several per launch: the 2-rank ones (a resumed run after the run it loads) in one
    launch, the 4-rank ones in another."""
    root = tmp_path_factory.mktemp("sequence_parallel")
    spec = {name: (NPROC.get(name, 2), [*COMMON, *overrides]) for name, overrides in RUNS.items()}
    for name, (source, overrides) in RESUMED.items():
        spec[name] = (spec[source][0], [*spec[source][1], f"resume={root / source}/checkpoints/step_3", *overrides])
    launches = {processes: [(name, base_args(tiny_model_dir, root / name, *args))
                            for name, (n, args) in spec.items() if n == processes]
                for processes in sorted({processes for processes, _ in spec.values()})}
    launches[2] += [(name, [*pair_args("dpo"), f"model.name_or_path={tiny_model_dir}", *overrides,
                            f"output_dir={root / name}"]) for name, overrides in DPO_CP.items()]
    return BatchedRuns(root, list(launches.items()))


@pytest.mark.parametrize("name", ["zero2_sp2", "zero3_sp2", "fsdp2_sp2", "fsdp2_sp2_unpacked", "fsdp2_dp2_sp2",
                                  "fsdp2_sp2_tp2", "fsdp2_cp2", "fsdp2_cp2_unpacked", "zero2_cp2", "fsdp2_sp2_cp2",
                                  "fsdp2_cp4", "fsdp2_cp2_tp2"])
def test_sp2_equals_sp1(runs, name, assert_close_series):
    """Loss and grad norm of every step within 1e-5 relative of the sp=1 run (the first within 1e-6), the same
    target-token count (each target counted once across the sp peers) and lr; the evaluations (steps 0 and 6, sharded
    too) within 1e-5; the Hugging Face export's config.json the reference's (no trace of the run's attention name)."""
    reference_dir = runs("ddp_packed" if "unpacked" not in name else "ddp")
    reference, reference_eval = read_metrics(reference_dir)
    ours, ours_eval = read_metrics(runs(name))
    assert [r["eval_tokens"] for r in ours_eval] == [r["eval_tokens"] for r in reference_eval]
    assert_close_series(ours_eval, reference_eval, "eval_loss", 1e-6, 1e-5)
    exported = json.loads((runs(name) / "hf" / "config.json").read_text())
    assert exported == json.loads((reference_dir / "hf" / "config.json").read_text())
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    assert [r["lr"] for r in ours] == [r["lr"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-5)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]


def test_live_all_to_all_and_activations_match_the_plan(runs):
    """The live cost of the first step (2 ranks, sp 2): 4 all-to-alls per layer forward and 4 backward per
    micro-batch (2 layers, accumulation 2: 32 calls), bytes at most the plan's (rows of max_seq_len; a batch's rows
    may be shorter) and within 20 % of it; activations measured at the shard's shape within 10 % of the planner's."""
    first = read_metrics(runs("zero2_sp2"))[0][0]
    plan = first["plan_comm_all_to_all_payload"]
    for rank in (0, 1):
        assert first[f"comm_r{rank}_all_to_all_calls"] == 4 * 2 * 2 * 2
        assert 0.8 * plan <= first[f"comm_r{rank}_all_to_all_payload"] <= plan
        measured, planned = first[f"memory_r{rank}_activations"], first[f"memory_r{rank}_plan_activations"]
        assert abs(measured / planned - 1) < 0.1, (measured, planned)


@pytest.mark.parametrize("name", ["zero2_sp2", "fsdp2_cp2"])
def test_bitwise_resume_with_sp2(runs, name):
    """6 steps straight vs the step-3 checkpoint resumed by a new run, both sp=2 on ZeRO-2 (cp=2 on FSDP2): the
    same."""
    straight, resumed = runs(name), runs(f"{name}_resumed")  # from straight's step 3 (RESUMED)
    reference, continued = read_metrics(straight)[0], read_metrics(resumed)[0]
    assert [r["step"] for r in continued] == [4, 5, 6]
    assert [r["loss"] for r in continued] == [r["loss"] for r in reference[3:]]
    assert [r["grad_norm"] for r in continued] == [r["grad_norm"] for r in reference[3:]]


@pytest.mark.parametrize("name", ["zero2_sp2", "fsdp2_sp2", "fsdp2_cp2"])
def test_checkpoint_loads_with_another_sp(runs, name, assert_close_series):
    """The step-3 checkpoint of an sp=2 (or cp=2) run resumed at sp=1 (cp=1, dp 2, micro 4: the same global batch)
    continues the straight run within 1e-5 (ZeRO partitions over all ranks either way; FSDP2's DCP reshards)."""
    straight, other = runs(name), runs(f"{name}_as_sp1")  # from straight's step 3 (RESUMED)
    reference, continued = read_metrics(straight)[0], read_metrics(other)[0]
    assert [r["step"] for r in continued] == [4, 5, 6]
    assert_close_series(continued, reference[3:], "loss", 1e-6, 1e-5)
    assert_close_series(continued, reference[3:], "grad_norm", 1e-6, 1e-5)


def test_live_ring_bytes_match_the_formula(runs):
    """cp 2, first step, each rank: per layer and micro-batch 1 send of its k and v forward, 1 of them and 2 of their
    fp32 gradients backward (2 layers × accumulation 2: 16 sends), each 2 · 8 rows × 32 tokens × (2 kv-heads × 16)
    fp32 elements (packed rows of 64): the planner's p2p bytes exactly (parallel/cp.py), its activations at the shard's
    shape within 10 %."""
    first = read_metrics(runs("fsdp2_cp2"))[0][0]
    block = 2 * 8 * 32 * 2 * 16 * 4
    for rank in (0, 1):
        assert first[f"comm_r{rank}_p2p_calls"] == 4 * 2 * 2
        assert first[f"comm_r{rank}_p2p_payload"] == first[f"comm_r{rank}_p2p_wire"] == 4 * 2 * 2 * block
        assert first["plan_comm_p2p_payload"] == first[f"comm_r{rank}_p2p_payload"]
        measured, planned = first[f"memory_r{rank}_activations"], first[f"memory_r{rank}_plan_activations"]
        assert abs(measured / planned - 1) < 0.1, (measured, planned)


def test_dpo_under_cp2_equals_ddp(runs, assert_close_series):
    """DPO, cp=2 on FSDP2 (dp 1, micro 4 pairs) against 2-rank DDP (micro 2): pairs and lr equal, loss and grad norm
    within 1e-5 relative (1e-6 on the first step: ln 2, the reference's log-probs sharded the same way), the
    evaluations too."""
    reference, ours = read_metrics(runs("dpo_ddp")), read_metrics(runs("dpo_fsdp2_cp2"))
    assert [r["pairs"] for r in ours[0]] == [r["pairs"] for r in reference[0]] == [8] * 6
    assert [r["lr"] for r in ours[0]] == [r["lr"] for r in reference[0]]
    for key in ("loss", "grad_norm"):
        assert_close_series(ours[0], reference[0], key, 1e-6, 1e-5)
    assert_close_series(ours[1], reference[1], "eval_loss", 1e-6, 1e-5, atol=1e-7)


def test_shards_attend_like_whole_rows(tmp_path):
    """Worker under torchrun, sp=2: per-token log-probs exact, summed loss and gradients to 1e-6 relative; pairs: the
    whole sequences' scores / log-probs on both peers, the loss counted once, gradients summed over the peers to
    1e-5 relative of the whole row's (an identity backward of the sum, not an all-reduce, misses them by > 100 %)."""
    reports = run_worker("tests.dist.workers.sequence_parallel_checks", tmp_path / "checks")
    assert [r["sp_rank"] for r in reports] == [0, 1] and all(r["dp"] == 1 for r in reports)
    for case, width, local in (("packed", 17, 9), ("unpacked", 11, 6), ("one_kv_head", 17, 9)):
        parts = [r[case] for r in reports]
        assert all((p["width"], p["shard_width"]) == (width, local) for p in parts)  # padded to 18 / 12, then cut
        assert sum(p["shard_targets"] for p in parts) == parts[0]["whole_targets"]  # each target counted once
        for p in parts:
            assert p["logp_max_abs"] <= 1e-6 and p["loss_rel"] <= 1e-6 and p["grad_max_rel"] <= 1e-5, (case, p)
    for case in ("reward", "simpo"):  # pairs: per-sequence values summed over the peers, each pair counted once
        parts = [r[case] for r in reports]
        assert [p["share"] for p in parts] == [1.0, 0.0] and parts[0]["width"] == 39
        assert sum(p["ends_here"] for p in parts) == 6 and parts[1]["ends_here"] > 0  # scores read on sp rank 1 too
        for p in parts:  # every peer holds the whole sequences' values and the whole loss
            assert p["values_max_abs"] <= 1e-5 and p["loss_rel"] <= 1e-6 and p["summed_loss_rel"] <= 1e-6, (case, p)
            assert p["grad_max_rel"] <= 1e-5, (case, p)
    names = {r[case]["name"] for r in reports[:1] for case in ("packed", "unpacked", "one_kv_head")}
    assert len(names) == 3  # a name of its own per registration
    assert all(r["globals_unchanged"] and r["packed_cut_inside_sample"] for r in reports)
