"""DeepSpeed under torchrun (gloo, 2 CPU ranks): parity with DDP for ZeRO-0/1/2/3 and ZeRO-3 + CPU offload,
accumulation-independence (DDP and ZeRO-2), bitwise resume (ZeRO-0 to 3), the ZeRO-1 <-> 2 switch on resume,
export round trip, 2 -> 1 reshard, model-state bytes, the non-finite stop, bad configs, NVMe offload.

Runs are grouped: each configuration below runs once and serves several tests, the module's runs in one launch per
rank count (the `runs` fixture). Every run loads the same saved tiny model, trains 12 steps of global batch 16
(micro 4 × accumulation 2 × 2 ranks) in fp32 with weight decay on (a wrong AdamW group under ZeRO-3 would show)
and saves at step 6.
Grad norm is compared too: Adam hides a gradient-scale bug in the loss, the norm does not.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    BatchedRuns,
    assert_stopped_nonfinite,
    batch_log,
    ranks_refused,
    read_metrics,
    run_cli,
)

pytestmark = pytest.mark.dist

COMMON = ["trainer.max_steps=12", "trainer.grad_accum_steps=2", "trainer.micro_batch_size=4",
          "optim.weight_decay=0.1", "trainer.save_every_n_steps=6", "trainer.keep_last_k=3"]
PACKED = ["data.packing=true", "model.dropout=0.1"]  # packing, and dropout: the RNG stream must match DDP's
RUNS = {  # name -> (nproc, overrides); "ddp*" are the references
    "ddp": (2, []),
    "ddp_packed": (2, PACKED),
    "zero0": (2, ["backend=zero0"]),
    "zero1": (2, ["backend=zero1"]),
    "zero2": (2, ["backend=zero2"]),
    "zero3": (2, ["backend=zero3"]),  # "auto" sizes: persistence threshold 10·h = 640, so ZeRO-3 partitions
    "zero3_fused": (2, ["backend=zero3", "model.fused_loss=chunked"]),  # against zero3's full logits (auto, V 263)
    "zero3_offload": (2, ["backend=zero3_offload", *PACKED]),  # every matrix of the tiny model
    # the same global batch 16 without accumulation (micro 8 × 1 × 2 ranks): equal to "ddp" / "zero2"
    "ddp_accum1": (2, ["trainer.micro_batch_size=8", "trainer.grad_accum_steps=1"]),
    "zero2_accum1": (2, ["backend=zero2", "trainer.micro_batch_size=8", "trainer.grad_accum_steps=1"]),
    # optim=muon: its momentum in DeepSpeed's flat partitions resumes bitwise (equality with torch.optim.Muon:
    # tests/dist/workers/muon_checks.py, in test_fsdp2's worker launch)
    "zero2_muon": (2, ["backend=zero2", "optim=muon"]),
}
REFERENCE = {name: "ddp_packed" if "data.packing=true" in args else "ddp" for name, (_, args) in RUNS.items()}
RESUMED = {  # name -> (the run whose step-6 checkpoint it resumes, nproc, overrides after that run's)
    **{f"{name}_resumed": (name, 2, ["data.num_workers=2"])
       for name in ("zero0", "zero1", "zero2", "zero3", "zero3_offload", "zero2_muon")},
    "zero1_as_zero2": ("zero1", 2, ["backend=zero2"]),
    "zero2_as_zero1": ("zero2", 2, ["backend=zero1"]),
    "zero2_on_one_rank": ("zero2", 1, ["trainer.micro_batch_size=8"]),
    "zero3_on_one_rank": ("zero3", 1, ["trainer.micro_batch_size=8"]),
}


def test_the_fused_head_equals_full_logits_under_zero3(runs, assert_close_series):
    """The LM head and loss fused over chunks (model.fused_loss=chunked: the head's weight gathered by ZeRO-3 inside
    its own forward, its gradient computed there) against full logits (auto's choice at V 263) on the same backend:
    every step's loss and grad norm within 1e-6 relative (1e-5 after Adam moved the weights apart by rounding)."""
    fused, full = read_metrics(runs("zero3_fused"))[0], read_metrics(runs("zero3"))[0]
    assert_close_series(fused, full, "loss", 1e-6, 1e-5)
    assert_close_series(fused, full, "grad_norm", 1e-6, 1e-5)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory, base_args) -> BatchedRuns:
    """Every run of RUNS, then those of RESUMED (and zero3_nvme where NVMe offload can run), in one launch per rank
    count: the 2-rank launch first, whose checkpoints the 1-rank one loads."""
    root = tmp_path_factory.mktemp("deepspeed")
    batches = {2: [(name, [*COMMON, *args]) for name, (_, args) in RUNS.items()], 1: []}
    if async_io_builds():
        batches[2].append(("zero3_nvme", [*COMMON, *RUNS["zero3"][1], *nvme_args(root / "nvme")]))
    for name, (base, nproc, extra) in RESUMED.items():
        batches[nproc].append((name, [*COMMON, *RUNS[base][1], f"resume={root / base}/checkpoints/step_6", *extra]))
    return BatchedRuns(root, [(nproc, [(name, base_args(tiny_model_dir, root / name, *args)) for name, args in batch])
                              for nproc, batch in batches.items()])


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3_offload"])
def test_parity_with_ddp(runs, name, assert_close_series):
    """Loss and grad norm of every step within 1e-5 relative of DDP (the first within 1e-6), same lr."""
    reference, ours = read_metrics(runs(REFERENCE[name]))[0], read_metrics(runs(name))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    assert [r["lr"] for r in ours] == [r["lr"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-5)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]
    config = json.loads((runs(name) / "deepspeed_config.json").read_text())
    assert config["gradient_clipping"] == 1.0 and config["train_batch_size"] == 16
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64  # "auto": the tiny model's hidden size squared
    assert zero.get("use_multi_rank_bucket_allreduce") is (False if name in ("zero1", "zero2") else None)


@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_accumulation_does_not_change_the_step(runs, name, assert_close_series):
    """Micro 8 × accumulation 1 equals micro 4 × accumulation 2 (2 ranks, global batch 16): loss and grad norm of
    every step to 1e-6 relative, the lr exactly."""
    reference, ours = read_metrics(runs(name))[0], read_metrics(runs(f"{name}_accum1"))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    assert [r["lr"] for r in ours] == [r["lr"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-6)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-6)


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3_offload", "zero2_muon"])
def test_bitwise_resume(runs, name):
    """12 steps straight vs the step-6 checkpoint resumed in a later run (other runs between; 2 data workers):
    identical."""
    straight, resumed = runs(name), runs(f"{name}_resumed")
    reference, continued = read_metrics(straight)[0], read_metrics(resumed)[0]
    assert [r["step"] for r in continued] == list(range(7, 13))
    assert [r["loss"] for r in continued] == [r["loss"] for r in reference[6:]]
    assert [r["grad_norm"] for r in continued] == [r["grad_norm"] for r in reference[6:]]
    engine = straight / "checkpoints" / "step_6" / "engines" / "policy"
    assert (engine / "ds").is_dir() and (straight / "checkpoints" / "step_6" / "COMPLETE").is_file()


@pytest.mark.parametrize("saved,resumed", [("zero1", "zero2"), ("zero2", "zero1")])
def test_resume_switches_between_zero1_and_zero2(runs, saved, resumed, assert_close_series):
    """A ZeRO-1 checkpoint continues under ZeRO-2 and back (same 2 ranks, through the universal checkpoint):
    weights, Adam moments and schedule survive, so steps 7-12 match the uninterrupted run to 1e-5."""
    straight, switched = runs(saved), runs(f"{saved}_as_{resumed}")
    reference, continued = read_metrics(straight)[0], read_metrics(switched)[0]
    assert [r["step"] for r in continued] == list(range(7, 13))
    assert [r["lr"] for r in continued] == [r["lr"] for r in reference[6:]]
    assert_close_series(continued, reference[6:], "loss", 1e-5, 1e-5)
    assert_close_series(continued, reference[6:], "grad_norm", 1e-5, 1e-5)
    config = json.loads((switched / "deepspeed_config.json").read_text())
    assert config["zero_optimization"]["stage"] == int(resumed[-1])
    assert (f"saved with ZeRO-{saved[-1]} on 2 dp ranks, this run is ZeRO-{resumed[-1]} on 2"
            in batch_log(switched))


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_reshard_two_ranks_to_one(runs, name, assert_close_series):
    """A checkpoint saved on 2 ranks resumes on 1 (micro 8: same global batch) through DeepSpeed's universal
    checkpoint: weights, Adam moments, fp32 master and schedule survive, so steps 7-12 match the 2-rank run."""
    straight, one = runs(name), runs(f"{name}_on_one_rank")
    reference, continued = read_metrics(straight)[0], read_metrics(one)[0]
    assert [r["step"] for r in continued] == list(range(7, 13))
    assert_close_series(continued, reference[6:], "loss", 1e-6, 1e-5)  # step 7: the weights are equal
    assert_close_series(continued, reference[6:], "grad_norm", 1e-6, 1e-5)


def test_export_from_zero3_shards_round_trips(runs):
    """The HF folder written from ZeRO-3 shards loads with from_pretrained; its logits equal the engine's
    (the fp32 partitions of the final checkpoint, consolidated by DeepSpeed's zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    run_dir = runs("zero3")
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32).eval()
    engine = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32).eval()
    shards = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints" / "step_12" / "engines" / "policy"),
                                                      tag="ds")
    engine.load_state_dict(shards, strict=False)
    assert set(shards) == {n for n, _ in engine.named_parameters()}
    ids = torch.randint(0, exported.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, engine(input_ids=ids).logits)
    ddp = AutoModelForCausalLM.from_pretrained(runs("ddp") / "hf", dtype=torch.float32)
    for name, param in ddp.named_parameters():  # same training, another backend: the same weights to 1e-5
        torch.testing.assert_close(param, shards[name], rtol=1e-4, atol=1e-5)


def expected_bytes(model_dir: Path, stage: int, dp: int = 2, offload: bool = False) -> dict[str, float]:
    """The planner's figures (llmtrain/metrics/cost.py, what `python -m llmtrain.plan` prints): fp32 weights,
    DeepSpeed's fp32 master partition (4M/N), gradients, Adam; ZeRO-3 keeps its persistent parameters whole
    ("auto" threshold 10·h); accumulation 2; `host`: what offload moves off the device."""
    from transformers import AutoModelForCausalLM

    from llmtrain.backends import BACKENDS
    from llmtrain.metrics.cost import Layout, RoleParams, state_bytes

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    numels, threshold = [p.numel() for p in model.parameters()], 10 * model.config.hidden_size
    placement = "cpu" if offload else "none"
    layout = Layout(name="zero", backend=BACKENDS["deepspeed"], stage=stage, dp=dp, offload_optimizer=placement,
                    offload_param=placement, persistence_threshold=threshold)
    role = RoleParams(trainable=sum(numels), persistent=sum(n for n in numels if n <= threshold) if stage == 3 else 0)
    planned = state_bytes(role, layout, "fp32", grad_accum_steps=2)
    return {"params": planned.weights, "master": planned.master, "grads": planned.grads, "optim": planned.optim,
            "host": planned.host}


@pytest.mark.parametrize("name,stage", [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero3_offload", 3)])
def test_model_state_bytes_match_the_formula(runs, tiny_model_dir, name, stage):
    first = read_metrics(runs(name))[0][0]
    expected = expected_bytes(tiny_model_dir, stage, offload=name == "zero3_offload")
    host = expected.pop("host")
    for rank in (0, 1):
        for role, value in expected.items():
            measured = first[f"memory_r{rank}_{role}_bytes"]
            assert abs(measured - value) <= 0.05 * value, f"rank {rank} {role}: {measured} vs {value}"
            assert first[f"memory_r{rank}_expected_{role}_bytes"] == pytest.approx(value)
        assert first[f"memory_r{rank}_other_bytes"] == 0  # every byte is in a named role
        total = sum(expected.values())
        assert abs(first[f"memory_r{rank}_total_bytes"] - total) <= 0.05 * total
    # offload: fp32 master, Adam state, gradient and weight partitions are the host's (4+8+4+4)·M/N
    assert host == (5 * expected["master"] if name == "zero3_offload" else 0)
    assert abs(first["memory_r0_host_bytes"] - host) <= 0.05 * host


def test_ddp_model_state_bytes_match_the_plan(runs, tiny_model_dir):
    """DDP (fp32, 2 ranks, accumulation 2): weights, gradients and Adam state as the planner predicts them."""
    from transformers import AutoModelForCausalLM

    from llmtrain.backends import BACKENDS
    from llmtrain.metrics.cost import Layout, RoleParams, state_bytes

    m = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    planned = state_bytes(RoleParams(trainable=m), Layout(name="ddp", backend=BACKENDS["ddp"], stage=0, dp=2),
                          "fp32", 2)
    first = read_metrics(runs("ddp"))[0][0]
    for rank in (0, 1):
        for key, value in (("params", planned.weights), ("grads", planned.grads), ("optimizer", planned.optim)):
            measured = first[f"memory_r{rank}_{key}"]
            assert abs(measured - value) <= 0.05 * value, f"rank {rank} {key}: {measured} vs {value}"


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3", "zero2_muon"])
def test_live_activations_and_communication_match_the_plan(runs, name, assert_live_cost_matches_the_plan):
    """Counted from the real collectives on step 2 (DDP's buckets through its comm hook, DeepSpeed's through
    torch.distributed): payload and ring wire bytes within 5 % of metrics/cost.py's theory per kind; activations
    measured with saved-tensor hooks within 25 % of the plan on both ranks. zero2_muon: Muon's all-gather of its
    flat update partitions (optim/zero_layout.py) beside ZeRO's own, planned by optim/spec.muon_gathers."""
    assert_live_cost_matches_the_plan(runs(name))


def _run_bad(tmp_path, *overrides):
    start = time.time()
    result = run_cli(["recipe=sft_tiny", f"output_dir={tmp_path / 'x'}", *overrides], nproc=2, timeout=120)
    return result, time.time() - start


def test_bad_configs_fail_on_every_rank_within_seconds(tmp_path):
    result, seconds = _run_bad(tmp_path, "backend=zero2", "backend.zero_stage=5", "backend.offload_param.device=cpu",
                               "backend.offload_optimizer.device=nvme",
                               "backend.ds_config_overrides={train_batch_size: 48}")
    reported = ranks_refused(result, 2)
    assert seconds < 60
    for field in ("backend.zero_stage=5", "backend.offload_param.device=cpu needs backend.zero_stage=3",
                  "backend.offload_optimizer.device=nvme needs backend.offload_optimizer.nvme_path",
                  "backend.ds_config_overrides.train_batch_size"):
        assert result.stderr.count(field) == len(reported), field  # once per rank that reported
    result, seconds = _run_bad(tmp_path, "backend=zero0", "backend.offload_optimizer.device=cpu",
                               "trainer.global_batch_size=48")
    reported = ranks_refused(result, 2)
    assert seconds < 60
    for field in ("backend.offload_optimizer.device=cpu needs backend.zero_stage >= 1", "trainer.global_batch_size=48"):
        assert result.stderr.count(field) == len(reported), field
    assert not (tmp_path / "x" / "checkpoints").exists()


def test_nonfinite_loss_stops_every_rank(tiny_model_dir, tmp_path, base_args):
    """fp32, lr 1e30: step 1's update makes the weights overflow, step 2's loss is NaN; every rank says so and
    exits with code 3 (torchrun reports the first rank to exit and stops the other), nothing is saved."""
    result = run_cli(base_args(tiny_model_dir, tmp_path / "run", *COMMON, "backend=zero2", "optim.lr=1e30",
                               "optim.warmup_steps=0", "optim.max_grad_norm=0", "trainer.max_steps=4"), nproc=2)
    assert_stopped_nonfinite(result, nproc=2, step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "run")[0]] == [1]
    assert not (tmp_path / "run" / "checkpoints").exists()


def nvme_args(nvme: Path) -> list[str]:
    nvme.mkdir()
    return [f"backend.offload_optimizer.nvme_path={nvme}", f"backend.offload_param.nvme_path={nvme}",
            "backend.offload_optimizer.device=nvme", "backend.offload_param.device=nvme", "trainer.max_steps=4",
            "trainer.save_every_n_steps=0"]


def async_io_builds() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def test_nvme_offload_without_libaio_stops_and_says_why(tiny_model_dir, tmp_path, base_args):
    """Without libaio the run stops before the model loads and names the missing op."""
    if async_io_builds():
        pytest.skip("DeepSpeed's async_io op builds here (libaio is installed): the NVMe offload test runs instead")
    result = run_cli(base_args(tiny_model_dir, tmp_path / "run", *COMMON, "backend=zero3",
                               *nvme_args(tmp_path / "nvme")), nproc=2)
    assert result.returncode != 0 and "async_io op, which cannot build here" in result.stderr
    assert "Loading weights" not in result.stderr + result.stdout


def test_nvme_offload_to_a_folder(runs, assert_close_series):
    """With libaio (CI installs libaio-dev) ZeRO-3 offloads optimizer state and parameters to a folder (the
    module's 2-rank launch runs it) and matches DDP."""
    if not async_io_builds():
        pytest.skip("DeepSpeed's AsyncIOBuilder is not compatible here (libaio missing: apt-get install libaio-dev), "
                    "so NVMe offload cannot run")
    nvme = runs.root / "nvme"
    run_dir = runs("zero3_nvme")
    assert any((nvme / "zero_stage_3").rglob("*")), "nothing was swapped to the NVMe folder"
    reference, ours = read_metrics(runs("ddp"))[0][:4], read_metrics(run_dir)[0]
    assert_close_series(ours[:2], reference[:2], "loss", 1e-6, 1e-5)  # same lr for the 2 warm-up steps
    assert_close_series(ours[:2], reference[:2], "grad_norm", 1e-6, 1e-5)
