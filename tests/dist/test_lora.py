"""peft=lora under torchrun (gloo, 2 CPU ranks): LoRA SFT parity of ZeRO-2 and FSDP2 with DDP, bitwise resume
on each, checkpoints that hold the adapters only, and exports (adapter/ + merged hf/) equal across backends.

Every run loads the same saved tiny Llama, adds r-4 adapters on every linear layer (A seeded per module name,
B = 0), trains 6 steps (micro 4 × accumulation 2 × 2 ranks) in fp32 and saves at step 3. Every run of the module
runs once, up front, in one 2-rank launch (the `runs` fixture), and serves several tests. Step 1's loss is the
base's (B = 0) whatever A is; its grad norm (the gradient of B is A·x) is what shows that A is the same on every
backend.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from tests.helpers import PYTHON, REPO, BatchedRuns, assert_ok, batch_log, cli_env, read_metrics

DATA = REPO / "llmtrain" / "assets" / "data"

pytestmark = pytest.mark.dist

COMMON = ["peft=lora", "peft.r=4", "peft.alpha=8", "trainer.max_steps=6", "trainer.grad_accum_steps=2",
          "trainer.micro_batch_size=4", "optim.weight_decay=0.1", "trainer.save_every_n_steps=3",
          "trainer.keep_last_k=3", "optim.lr=1e-2"]
BACKENDS = {"ddp": [], "zero2": ["backend=zero2"], "zero3": ["backend=zero3"], "fsdp2": ["backend=fsdp2"]}
DPO_LORA = ["peft=lora", "peft.r=4", "peft.alpha=8", "optim.lr=1e-2"]  # after the pair run's arguments


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory, base_args, pair_args):
    """Every run of the module, up front, in one 2-rank launch (tests/dist/workers/batched_runs.py): BACKEND (SFT),
    BACKEND_resumed (from BACKEND's step 3, after every straight run) and dpo_BACKEND (DPO with LoRA, the reference
    the policy with adapters off, 6 steps of 8 pairs, eval at 0, 3, 6). -> `runs(name)`: the run's folder, finished."""
    root = tmp_path_factory.mktemp("lora")

    def sft(name: str, backend: str, *extra: str) -> tuple[str, list[str]]:
        return name, base_args(tiny_model_dir, root / name, *COMMON, *BACKENDS[backend], *extra)

    def dpo(backend: str) -> tuple[str, list[str]]:
        return f"dpo_{backend}", [*pair_args("dpo"), f"model.name_or_path={tiny_model_dir}", *DPO_LORA,
                                  *BACKENDS[backend]]

    kto_eval = root / "kto_eval.jsonl"  # 64 held-out pairs (tests/dist/test_preference.py's)
    kto_eval.write_text("".join((DATA / "reverse_prefs_easy_eval.jsonl").read_text().splitlines(True)[:64]))

    def kto(backend: str) -> tuple[str, list[str]]:
        return f"kto_{backend}", [*pair_args("kto"), f"model.name_or_path={tiny_model_dir}", *DPO_LORA,
                                  *BACKENDS[backend], f"data.eval_files=[{kto_eval}]"]

    batch = [*(sft(backend, backend) for backend in BACKENDS), *(dpo(backend) for backend in ("ddp", "zero3", "fsdp2")),
             *(kto(backend) for backend in ("ddp", "fsdp2"))]
    batch += [sft(f"{backend}_resumed", backend, f"resume={root / backend}/checkpoints/step_3") for backend in BACKENDS]
    return BatchedRuns(root, [(2, batch)])


@pytest.mark.parametrize("backend", ["zero2", "zero3", "fsdp2"])
def test_parity_with_ddp(runs, backend, assert_close_series):
    """Loss and grad norm of every step within 1e-5 relative of DDP (the first 1e-6), same lr and tokens."""
    reference, ours = read_metrics(runs("ddp"))[0], read_metrics(runs(backend))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    assert [r["lr"] for r in ours] == [r["lr"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-5)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_bitwise_resume(runs, backend):
    """6 steps straight vs the step-3 checkpoint (adapters and their optimizer state only) resumed in a later run
    (after every straight run of the launch: nothing of the straight run is left in the process): identical. The
    base is rebuilt from its source; the adapters come back on every rank (FSDP2: each rank's shard; a rank left
    with B = 0 or its seeded A would change step 4)."""
    straight, resumed = runs(backend), runs(f"{backend}_resumed")
    reference, continued = read_metrics(straight)[0], read_metrics(resumed)[0]
    assert [r["step"] for r in continued] == [4, 5, 6]
    assert [r["loss"] for r in continued] == [r["loss"] for r in reference[3:]]
    assert [r["grad_norm"] for r in continued] == [r["grad_norm"] for r in reference[3:]]


def test_ddp_checkpoint_holds_the_adapters_only(runs):
    engine = runs("ddp") / "checkpoints" / "step_3" / "engines" / "policy"
    state = torch.load(engine / "model.pt", weights_only=True)
    assert state and all("lora_A" in k or "lora_B" in k for k in state)
    assert len(state) == 2 * 14  # A and B of q, k, v, o, gate, up, down in 2 layers


def test_fsdp2_checkpoint_holds_the_adapter_shards_only(runs):
    from torch.distributed.checkpoint import FileSystemReader

    dcp_dir = runs("fsdp2") / "checkpoints" / "step_3" / "engines" / "policy" / "dcp"
    keys = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 2 * 14 and all("lora_" in k for k in model_keys)
    assert len(list(dcp_dir.glob("*.distcp"))) == 2  # one shard file per rank


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_adapter_export_holds_whole_matrices(runs, backend):
    """adapter/ after a save: every LoRA tensor 2-D and non-empty (ZeRO-3 and FSDP2 hold shards: saving them without
    gathering writes empty or flat tensors), shaped (r, d_in) for A and (d_out, r) for B."""
    from safetensors.torch import load_file

    state = load_file(runs(backend) / "adapter" / "adapter_model.safetensors")
    assert len(state) == 2 * 14
    for name, tensor in state.items():
        assert tensor.ndim == 2 and tensor.numel() > 0, (name, tensor.shape)
        assert tensor.shape[0 if "lora_A" in name else 1] == 4, (name, tensor.shape)


def test_exports_are_equal_across_backends_and_load(runs, tiny_model_dir):
    """adapter/ loads with PeftModel.from_pretrained(base, adapter); hf/ (merged) gives the same logits, and
    every backend exports the same weights to 1e-5."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = {}
    with torch.no_grad():
        for backend in BACKENDS:
            merged = AutoModelForCausalLM.from_pretrained(runs(backend) / "hf", dtype=torch.float32).eval()
            logits[backend] = merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, runs("fsdp2") / "adapter").eval()
        torch.testing.assert_close(adapted(input_ids=ids).logits, logits["fsdp2"], rtol=0, atol=1e-4)
    for backend in ("zero2", "zero3", "fsdp2"):
        torch.testing.assert_close(logits[backend], logits["ddp"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["ddp", "zero3", "fsdp2"])
def test_dpo_reference_by_adapter_switch(runs, backend, assert_close_series):
    """DPO + LoRA on 2 ranks: the reference is the policy with adapters disabled (logged, a pointer in the
    checkpoint, no engine of its own); step 1's loss is ln 2 with rewards 0, the policy moves away after, and
    ZeRO-3 (the view's forward gathers through the policy's engine) and FSDP2 match DDP (loss, grad norm, eval
    loss) to 1e-5."""
    run_dir = runs(f"dpo_{backend}")
    assert "reference: the policy with adapters disabled (no second copy of the base)" in batch_log(run_dir)
    train, evals = read_metrics(run_dir)
    first = train[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6 and first["reward_margin"] == 0 and first["reward_accuracy"] == 0
    assert all(r["reward_margin"] != 0 for r in train[1:])
    reference_dir = run_dir / "checkpoints" / "step_3" / "engines" / "reference"
    assert [p.name for p in reference_dir.iterdir()] == ["frozen.json"]
    assert json.loads((reference_dir / "frozen.json").read_text())["adapter_off_of"] == "policy"
    assert not any(k.startswith("reference_memory") for r in train for k in r)
    if backend != "ddp":
        reference_train, reference_evals = read_metrics(runs("dpo_ddp"))
        for key in ("loss", "grad_norm"):
            assert_close_series(train, reference_train, key, 1e-6, 1e-5)
        assert_close_series(evals, reference_evals, "eval_loss", 1e-6, 1e-5)


def test_kto_reference_by_adapter_switch(runs, assert_close_series):
    """KTO + LoRA on 2 ranks: the reference is the policy with adapters off (a pointer in the checkpoint); step 1's
    loss is 0.5 (every completion's 1 − σ(0)) with z0 = 0, and FSDP2 matches DDP (loss, grad norm, z0, eval loss)."""
    train, evals = read_metrics(runs("kto_fsdp2"))
    reference_train, reference_evals = read_metrics(runs("kto_ddp"))
    assert abs(train[0]["loss"] - 0.5) < 1e-6 and train[0]["kl"] == 0
    assert all(r["reward_margin"] != 0 for r in train[1:])
    reference_dir = runs("kto_fsdp2") / "checkpoints" / "step_3" / "engines" / "reference"
    assert json.loads((reference_dir / "frozen.json").read_text())["adapter_off_of"] == "policy"
    for key in ("loss", "grad_norm"):
        assert_close_series(train, reference_train, key, 1e-6, 1e-5)
    assert_close_series(train, reference_train, "kl", 1e-5, 1e-5, atol=1e-6)
    assert_close_series(evals, reference_evals, "eval_loss", 1e-6, 1e-5)


@pytest.mark.parametrize("backend, stage", [("ddp", 0), ("fsdp2", 3)])
def test_planned_model_state_bytes_count_the_base_as_weights_only(runs, backend, stage):
    """metrics/memory.planned_state_bytes (the plan's figure: adapters with grads and Adam, the frozen base as fp32
    weights, sharded under FSDP2) within 5 % of what each rank's engine measured after step 1; and ZeRO-3's
    measured parameter bytes within 5 % of its expected ones (frozen partitions counted)."""
    import re

    from llmtrain.backends import BACKENDS
    from llmtrain.metrics.memory import frozen_elem_bytes, planned_state_bytes

    run_dir = runs(backend)
    trainable, total = map(int, re.search(r"lora: (\d+) trainable parameters of (\d+)",
                                          batch_log(run_dir)).groups())
    planned = planned_state_bytes(trainable=trainable, frozen=total - trainable, stage=stage, dp=2,
                                  mixed_precision=False,
                                  frozen_elem_bytes=frozen_elem_bytes(BACKENDS[backend].frozen_in_compute_dtype, False))
    first = read_metrics(run_dir)[0][0]
    for rank in range(2):
        measured = sum(first[f"memory_r{rank}_{k}"] for k in ("params", "grads", "optimizer"))
        assert abs(measured - planned) <= 0.05 * planned, (rank, measured, planned)
    full = planned_state_bytes(trainable=total, frozen=0, stage=stage, dp=2, mixed_precision=False,
                               frozen_elem_bytes=4)
    assert planned < 0.5 * full  # what the old plan (every parameter trainable) would have said
    zero3 = read_metrics(runs("zero3"))[0][0]
    assert abs(zero3["memory_r1_params_bytes"] - zero3["memory_r1_expected_params_bytes"]) <= \
        0.05 * zero3["memory_r1_expected_params_bytes"], zero3


def test_fsdp2_resume_restores_every_ranks_adapter_shard(tiny_model_dir, tmp_path):
    """Worker under torchrun, 2 ranks (tests/dist/workers/lora_adapter_shards.py): a trained LoRA model's DCP
    checkpoint loaded into the same model after its adapter shards (and Adam state) were zeroed: every rank's shard
    of every adapter comes back bitwise (a full state dict that kept only rank 0's shard would leave rank 1's at
    zero)."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m",
           "tests.dist.workers.lora_adapter_shards", str(tiny_model_dir), str(tmp_path)]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert_ok(result)
    ranks = [torch.load(tmp_path / f"rank_{rank}.pt") for rank in range(2)]
    names = ranks[0]["global_numel"].keys()
    assert len(names) == 28 and all(r[key].keys() == names for r in ranks for key in r), "28 adapters on each rank"
    for name, numel in ranks[0]["global_numel"].items():  # the two local shards are the whole adapter, each non-empty
        assert all(r["trained"][name].numel() > 0 for r in ranks)
        assert sum(r["trained"][name].numel() for r in ranks) == numel, name
    for rank, evidence in enumerate(ranks):
        for name in names:
            for kind in ("", "_exp_avg"):  # the adapter's shard, Adam's first moment of it
                trained, zeroed, loaded = (evidence[f"{when}{kind}"][name] for when in ("trained", "zeroed", "loaded"))
                assert trained.any() and not zeroed.any(), (rank, name, kind)  # trained away from 0, then zeroed
                assert torch.equal(loaded, trained), (rank, name, kind)  # the checkpoint gave back this rank's shard
    assert any(not torch.equal(ranks[0]["trained"][n], ranks[1]["trained"][n]) for n in names)  # shards, not copies
