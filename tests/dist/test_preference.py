"""Reward model, DPO, SimPO, ORPO and KTO under torchrun (gloo, 2 CPU ranks): parity of ZeRO-2, ZeRO-3 and FSDP2 with
DDP, frozen reference engines on every backend, bitwise resume, random init that does not depend on the backend, and
sequence parallelism (backend.sp=2: both ranks share every packed row of pairs, dp 1) against the DDP runs.

Every pair run loads the same saved tiny Llama (the reward head, missing from it, comes from the seeded init),
trains 6 steps of 8 pairs (micro 2 pairs × accumulation 2 × 2 ranks) in fp32 and saves at step 3 (the `pair_args`
fixture, tests/dist/conftest.py, shared with test_lora.py). Every run of the module runs once, up front, in one
launch per rank count (tests/dist/workers/batched_runs.py: 1 process, 2 ranks, 4 ranks), and serves several tests.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import REPO, BatchedRuns, read_metrics

pytestmark = pytest.mark.dist

DATA = REPO / "llmtrain" / "assets" / "data"
BACKENDS = {"ddp": [], "zero2": ["backend=zero2"], "zero3": ["backend=zero3"], "fsdp2": ["backend=fsdp2"]}
STAGES = ("rm", "dpo", "simpo", "orpo", "kto")
COUNTED = {"kto": "completions"}  # what a step counts (the others: pairs)
FROM_CONFIG = ["recipe=sft_tiny", "trainer.max_steps=1", "trainer.eval_every_n_steps=1", "trainer.save_every_n_steps=0",
               "model.dropout=0.0", "trainer.seed=5"]
FROM_CONFIG_RUNS = {"single": ("ddp", 1), "ddp": ("ddp", 2), "zero3": ("zero3", 2), "fsdp2": ("fsdp2", 2)}
# test_parity_with_ddp's (backend, stage) pairs (its docstring says why not all twelve)
PARITY = [("zero2", "dpo"), ("zero3", "rm"), ("zero3", "dpo"), ("zero3", "simpo"), ("zero3", "orpo"), ("fsdp2", "rm"),
          ("fsdp2", "dpo"), ("fsdp2", "orpo"), ("zero3", "kto"), ("fsdp2", "kto")]
SP2 = ("backend.sp=2", "trainer.micro_batch_size=4")  # dp 1: the same 8 pairs a step as dp 2 × micro 2
SP_RUNS = {  # tag -> (stage, backend, overrides, ranks)
    "rm_zero2": ("rm", "zero2", SP2, 2),
    "dpo_fsdp2": ("dpo", "fsdp2", SP2, 2),
    # the reference's log-probs computed once, before training, on sequence shards (stages/reference_cache.py)
    "dpo_zero2_precomputed": ("dpo", "zero2", (*SP2, "dpo.precompute_ref_logps=true"), 2),
    "orpo_zero3_dp2": ("orpo", "zero3", ("backend.sp=2",), 4),  # 4 ranks: dp 2 × sp 2, micro 2 as DDP's
    "kto_zero2": ("kto", "zero2", SP2, 2),  # completions and their KL sequences sharded, z0 over the global batch
}
PAIR_RUNS = {  # name -> (stage, backend, overrides, ranks)
    **{f"{stage}_ddp": (stage, "ddp", (), 2) for stage in STAGES},
    **{f"{stage}_{backend}": (stage, backend, (), 2) for backend, stage in PARITY},
    **{f"{stage}_fsdp2_fused": (stage, "fsdp2", ("model.fused_loss=chunked",), 2) for stage in ("dpo", "orpo")},
    "dpo_zero3_precomputed": ("dpo", "zero3", ("dpo.precompute_ref_logps=true",), 2),
    "kto_fsdp2_precomputed": ("kto", "fsdp2", ("kto.precompute_ref_logps=true",), 2),
    **{f"{tag}_sp2": spec for tag, spec in SP_RUNS.items()},
}
# runs resumed from their step-3 checkpoint into NAME_resumed, in the same launch after every straight run
RESUMED = ("rm_fsdp2", "dpo_ddp", "dpo_zero3", "dpo_fsdp2", "simpo_zero3", "orpo_fsdp2", "dpo_zero3_precomputed",
           "kto_zero3")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory, pair_args):
    """Every run of the module, up front: one launch per rank count. -> `runs(name)`: the run's folder, finished."""
    root = tmp_path_factory.mktemp("preference")
    eval_file = root / "eval.jsonl"
    eval_file.write_text("".join((DATA / "reverse_eval.jsonl").read_text().splitlines(True)[:32]))
    kto_eval = root / "kto_eval.jsonl"  # 64 held-out pairs: KTO's eval forwards 4 sequences a pair (and KL ones)
    kto_eval.write_text("".join((DATA / "reverse_prefs_easy_eval.jsonl").read_text().splitlines(True)[:64]))
    launches: dict[int, list[tuple[str, list[str]]]] = {}

    def add(name: str, ranks: int, args: list[str]) -> None:
        launches.setdefault(ranks, []).append((name, args))

    def pair(name: str, *extra: str) -> list[str]:
        stage, backend, overrides, _ = PAIR_RUNS[name]
        own = [f"data.eval_files=[{kto_eval}]"] if stage == "kto" else []
        return [*pair_args(stage), f"model.name_or_path={tiny_model_dir}", *BACKENDS[backend], *overrides, *own,
                *extra]

    for name, (*_, ranks) in PAIR_RUNS.items():
        add(name, ranks, pair(name))
    for name in RESUMED:
        add(f"{name}_resumed", PAIR_RUNS[name][3], pair(name, f"resume={root / name}/checkpoints/step_3"))
    for name, (backend, ranks) in FROM_CONFIG_RUNS.items():
        add(f"from_config_{name}", ranks, [*FROM_CONFIG, *BACKENDS[backend], f"data.eval_files=[{eval_file}]",
                                           f"trainer.micro_batch_size={8 // ranks}"])
    return BatchedRuns(root, list(launches.items()))


@pytest.mark.parametrize("backend, stage", PARITY)
def test_parity_with_ddp(runs, stage, backend, assert_close_series):
    """Loss, grad norm and every logged statistic per step within 1e-5 relative of DDP (the first step 1e-6),
    and the step-0 and later evals: the seeded reward head is the same on every backend. Not all twelve pairs:
    ZeRO-2 by DPO only (test_sp2_equals_ddp's rm_zero2 and dpo_zero2_precomputed compare ZeRO-2 with DDP too), and
    SimPO on ZeRO-3 only (FSDP2 by RM, DPO and ORPO); every stage and backend keeps a parity check with DDP."""
    reference, ours = read_metrics(runs(f"{stage}_ddp")), read_metrics(runs(f"{stage}_{backend}"))
    counted = COUNTED.get(stage, "pairs")
    assert [r[counted] for r in ours[0]] == [r[counted] for r in reference[0]] == [8] * 6
    assert [r["lr"] for r in ours[0]] == [r["lr"] for r in reference[0]]
    for key in ("loss", "grad_norm"):
        assert_close_series(ours[0], reference[0], key, 1e-6, 1e-5)
    assert [e["step"] for e in ours[1]] == [0, 3, 6]
    assert_close_series(ours[1], reference[1], "eval_loss", 1e-6, 1e-5)
    if stage == "rm":
        assert reference[0][-1]["loss"] < reference[0][0]["loss"]
    else:  # the policy moved away from the reference (6 steps of a random tiny model do not lower DPO's loss)
        assert all(r["reward_margin"] != 0 for r in reference[0][1:])


@pytest.mark.parametrize("stage", ["dpo", "orpo"])
def test_the_fused_head_equals_full_logits_under_fsdp2(runs, stage, assert_close_series):
    """Sequence log-probs from the fused head (model.fused_loss=chunked: each chunk's logits recomputed in backward)
    against full logits (auto's choice at V 263) on FSDP2 (the root's head weight unsharded for the forward): every
    step's loss, grad norm and eval within 1e-6 relative on the first step, 1e-5 after."""
    fused = read_metrics(runs(f"{stage}_fsdp2_fused"))
    full = read_metrics(runs(f"{stage}_fsdp2"))  # model.fused_loss=auto: full logits at the tiny vocabulary
    # the margin is β × a difference of sequence log-prob sums of tens of nats: one fp32 ulp of such a sum is ~4e-6,
    # so the fused head's other summation order moves it by ~1e-7 (seen: 1.2e-7 apart at a margin of 2.7e-4)
    for key in ("loss", "grad_norm", "reward_margin"):
        assert_close_series(fused[0], full[0], key, 1e-6, 1e-5, atol=1e-6 if key == "reward_margin" else 0.0)
    assert_close_series(fused[1], full[1], "eval_loss", 1e-6, 1e-5)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_dpo_starts_at_ln2_with_a_frozen_reference_that_saves_no_state(runs, backend):
    """Policy and frozen reference start from the same weights: step 1's loss is ln 2 and its implied rewards 0
    on every backend; the reference's checkpoint is a pointer, not weights or optimizer state."""
    run_dir = runs(f"dpo_{backend}")
    first = read_metrics(run_dir)[0][0]
    assert abs(first["loss"] - math.log(2)) < 1e-6 and first["reward_margin"] == 0 and first["reward_accuracy"] == 0
    reference_dir = run_dir / "checkpoints" / "step_3" / "engines" / "reference"
    assert [p.name for p in reference_dir.iterdir()] == ["frozen.json"]
    assert json.loads((reference_dir / "frozen.json").read_text())["frozen"] is True
    assert any((run_dir / "checkpoints" / "step_3" / "engines" / "policy").iterdir())


@pytest.mark.parametrize("stage, backend", [("rm", "fsdp2"), ("dpo", "ddp"), ("dpo", "zero3"), ("dpo", "fsdp2"),
                                            ("simpo", "zero3"), ("orpo", "fsdp2"), ("kto", "zero3")])
def test_bitwise_resume(runs, stage, backend):
    """6 steps straight vs the step-3 checkpoint resumed in a later run (after every straight run of the launch:
    nothing of the straight run is left in the process): identical losses and statistics (frozen roles are rebuilt
    from their source, the stage's state comes back from stage.json)."""
    straight, resumed = runs(f"{stage}_{backend}"), runs(f"{stage}_{backend}_resumed")
    reference, continued = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in continued[0]] == [4, 5, 6]
    assert [_logged(r) for r in continued[0]] == [_logged(r) for r in reference[0][3:]]
    assert continued[1][-1]["eval_loss"] == reference[1][-1]["eval_loss"]
    stage_state = json.loads((straight / "checkpoints" / "step_3" / "stage.json").read_text())
    if stage == "rm":  # the last eval's reward statistics: what the export writes into config.json
        assert stage_state["reward_stats"]["reward_std"] > 0
        exported = json.loads((resumed / "hf" / "config.json").read_text())
        assert exported["reward_mean"] == reference[1][-1]["eval_reward_mean"]


def test_precomputed_reference_logps_train_as_the_live_reference_and_resume_bitwise(runs, assert_close_series):
    """dpo.precompute_ref_logps on ZeRO-3 (the reference's sharded forward over every rank's share of the train and
    eval pairs, once): the same losses, grad norms and evals as the in-step reference (1e-6 relative: the reference
    saw other batch shapes), the table beside the run, no reference engine in the checkpoints; resumed at step 3 into
    another folder it reads the table beside the resumed run (no reference built, nothing recomputed), keeps a copy
    and continues bit for bit."""
    live = read_metrics(runs("dpo_zero3"))
    straight = runs("dpo_zero3_precomputed")
    cached = read_metrics(straight)
    for key in ("loss", "grad_norm", "reward_margin"):
        assert_close_series(cached[0], live[0], key, 1e-6, 1e-6, atol=1e-7)
    assert_close_series(cached[1], live[1], "eval_loss", 1e-6, 1e-6)
    table = torch.load(straight / "ref_logps.pt", weights_only=True)
    assert table["meta"]["averaged"] is False and len(table["table"]) >= 32  # the 32 eval pairs, and the trained
    assert sorted(p.name for p in (straight / "checkpoints" / "step_3" / "engines").iterdir()) == ["policy"]
    log = runs.log("dpo_zero3_precomputed")
    assert "reference log-probs of" in log and "the reference role is released" in log
    resumed = runs("dpo_zero3_precomputed_resumed")
    resumed_log = runs.log("dpo_zero3_precomputed_resumed")
    assert "reference log-probs of" not in resumed_log and (resumed / "ref_logps.pt").is_file()  # read, kept
    continued = read_metrics(resumed)
    assert [_logged(r) for r in continued[0]] == [_logged(r) for r in cached[0][3:]]


@pytest.mark.parametrize("tag", list(SP_RUNS))
def test_sp2_equals_ddp(runs, tag, assert_close_series):
    """backend.sp=2 (each rank holds half of every packed row; the per-sequence log-prob sums, target counts and the
    reward model's scores at the last tokens summed over the sp peers, each pair counted once) against the 2-rank DDP
    run on the same global batch: pairs and lr equal, loss, grad norm and the pair statistics per step within 1e-5
    relative (1e-6 on the first step), and the evaluations at steps 0, 3 and 6 (sharded too). DPO's frozen reference
    is sharded the same way, live or precomputed: step 1 is ln 2 with zero implied rewards. ORPO on ZeRO-3 runs
    dp 2 × sp 2 on 4 ranks (ZeRO partitions over all 4, the loss sums over dp × sp)."""
    stage = SP_RUNS[tag][0]
    reference, ours = read_metrics(runs(f"{stage}_ddp")), read_metrics(runs(f"{tag}_sp2"))
    counted = COUNTED.get(stage, "pairs")
    assert [r[counted] for r in ours[0]] == [r[counted] for r in reference[0]] == [8] * 6
    assert [r["lr"] for r in ours[0]] == [r["lr"] for r in reference[0]]
    for key in ("loss", "grad_norm"):
        assert_close_series(ours[0], reference[0], key, 1e-6, 1e-5)
    # Means of whole-sequence values (counted once: a pair counted by both peers would double them). Looser: they are
    # small differences of O(1) terms (rm's rewards ~0.03 drift 8e-7 by step 2; ZeRO-2 without sp drifts 2e-7).
    statistics = {"rm": ("margin", "reward_chosen"), "dpo": ("reward_margin", "logp_chosen"),
                  "orpo": ("nll_loss", "log_odds_ratio"), "kto": ("reward_margin", "kl")}[stage]
    for key in statistics:
        assert_close_series(ours[0], reference[0], key, 1e-5, 1e-4, atol=2e-6)
    assert [e["eval_pairs"] for e in ours[1]] == [e["eval_pairs"] for e in reference[1]]
    for key in ("eval_loss", "eval_reward_mean") if stage == "rm" else ("eval_loss", "eval_reward_margin"):
        assert_close_series(ours[1], reference[1], key, 1e-6, 1e-5, atol=1e-7)
    if stage == "dpo":
        assert abs(ours[0][0]["loss"] - math.log(2)) < 1e-6 and ours[0][0]["reward_margin"] == 0


def _logged(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_s") and not k.startswith("memory")}


def test_random_init_is_the_same_on_every_backend_and_world_size(runs):
    """model.from_config (seed 5): the step-0 eval loss, a function of every weight, is the same on 1 process,
    2-rank DDP, ZeRO-3 (built under zero.Init) and FSDP2 (rank 0 builds, the others on meta)."""
    losses = {name: read_metrics(runs(f"from_config_{name}"))[1][0]["eval_loss"] for name in FROM_CONFIG_RUNS}
    for _name, loss in losses.items():
        assert abs(loss - losses["single"]) <= 1e-6 * losses["single"], losses


def test_kto_starts_at_one_half_and_precomputed_reference_trains_as_the_live_one(runs, assert_close_series):
    """KTO: at step 1 the policy is its reference, so every completion's loss is 1 − σ(0) = 0.5 and z0 = 0 on every
    backend; kto.precompute_ref_logps on FSDP2 (the table holds each completion's and its KL sequence's reference
    log-probs) trains as the in-step reference within 1e-6 relative, evals included."""
    for backend in ("ddp", "zero3", "fsdp2"):
        first = read_metrics(runs(f"kto_{backend}"))[0][0]
        assert abs(first["loss"] - 0.5) < 1e-6 and first["kl"] == 0 and first["reward_margin"] == 0, backend
    live, cached = read_metrics(runs("kto_fsdp2")), read_metrics(runs("kto_fsdp2_precomputed"))
    for key in ("loss", "grad_norm", "reward_margin", "kl"):
        assert_close_series(cached[0], live[0], key, 1e-6, 1e-6, atol=1e-7)
    assert_close_series(cached[1], live[1], "eval_loss", 1e-6, 1e-6)
    assert (runs("kto_fsdp2_precomputed") / "ref_logps.pt").is_file()
    assert not (runs("kto_fsdp2_precomputed") / "checkpoints" / "step_3" / "engines" / "reference").exists()
