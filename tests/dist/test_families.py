"""Every common model family trains: tiny random models (tests/dist/conftest.py FAMILIES: Llama-3, Qwen2, Qwen3,
Mistral, Gemma-2, Gemma-3 text, Phi-3, GPT-2, Mixtral, Qwen3-MoE) × {SFT on packed rows, DPO, GRPO}, 2 steps each,
one process per family running its three stages (tests/dist/workers/batched_runs.py), two families at a time.
Then Gemma-2 (eager attention), Qwen3 and the two MoE families (router aux loss) train the same 3 SFT steps on
ZeRO-3 and FSDP2 as on DDP, 2 ranks, fp32: loss, grad norm and aux loss within 1e-5 relative; one torchrun launch
per backend runs the four families. Tensor parallelism (2 ranks: dp 1 × tp 2) trains the families whose TP plans
use more than Llama's styles (tests/dist/conftest.py TP_FAMILIES) as one process does on the same micro-batches.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from tests.helpers import assert_batch_ok, batch_log, read_metrics, start_batch

pytestmark = pytest.mark.dist

QUIET = ["trainer.eval_every_n_steps=0", "data.eval_files=[]", "trainer.save_every_n_steps=0",
         "trainer.log_every_n_steps=0", "trainer.max_steps=2"]
STAGES = {"sft": ["recipe=sft_tiny", "data.packing=true", "trainer.micro_batch_size=4", "trainer.grad_accum_steps=2"],
          "dpo": ["recipe=dpo_tiny", "trainer.micro_batch_size=2", "trainer.grad_accum_steps=2"],
          "grpo": ["recipe=grpo_tiny", "ppo.rollout.prompts_per_step=2", "ppo.rollout.n_samples_per_prompt=2",
                   "ppo.rollout.max_new_tokens=8", "ppo.mini_batch_size=4", "ppo.epochs=1",
                   "trainer.micro_batch_size=2"]}
PARITY = ["recipe=sft_tiny", "data.packing=true", "trainer.max_steps=3", "trainer.micro_batch_size=2",
          "trainer.grad_accum_steps=2", "trainer.eval_every_n_steps=0", "data.eval_files=[]",
          "trainer.save_every_n_steps=0", "trainer.log_every_n_steps=0", "optim.lr=1e-3", "optim.warmup_steps=2"]
BACKENDS = {"ddp": [], "zero3": ["backend=zero3"], "fsdp2": ["backend=fsdp2"]}
# dp 1 × tp 2 reads the micro-batches one process reads (micro 4 × accumulation 2): the MoE aux loss, a mean over
# micro-batches of a non-linear function of each, is then compared on the same ones
TP_LAYOUTS = {"dp1": (1, ["trainer.micro_batch_size=4"]),
              "tp2": (2, ["trainer.micro_batch_size=4", "backend=fsdp2_tp"])}
# The LM head under tp (models/vocab_parallel.py): one step of a Llama's SFT (the summed loss, gradients computed in the
# forward) and DPO (per-token log-probs, recomputed in backward), appended to the TP_LAYOUTS launches. The reference:
# one process with full logits (model.fused_loss=off). tp2: the fused head (model.fused_loss=chunked: auto keeps full
# logits at V 263) split over the vocabulary, and fused_loss=off (the head replicated over tp). Adam's first update is
# lr·g/(|g| + eps): with eps 1, lr 1, no warm-up and no clipping it is g/(|g| + 1), nearly the gradient itself, so the
# weights after the step show every gradient entry's difference (with eps 1e-8 the update is ±lr wherever |g| >> 1e-8
# and shows nothing, while entries of |g| ~ 1e-8 amplify rounding: one process's fused and unfused heads differ by 5e-5
# of a weight's scale, 2 steps).
HEAD_STEP = ["trainer.max_steps=1", "optim.lr=1.0", "optim.eps=1.0", "optim.warmup_steps=0", "optim.max_grad_norm=0"]
HEAD_STAGES = {"sft": PARITY, "dpo": ["recipe=dpo_tiny", "trainer.micro_batch_size=4", "trainer.grad_accum_steps=2",
                                      *QUIET]}
# Expert parallelism (parallel/ep.py, fsdp2 backend.ep=2: the experts split over the 2 ranks, tokens exchanged
# all-to-all; ep carved from dp_shard, so dp stays 2) in one 2-rank launch: each EP family against DDP on the same
# global batch (Qwen2-MoE's DDP run in this launch: it is not a parity family), then Mixtral saved at step 2 of 4 and
# resumed at ep 2 (bitwise) and at ep 1 (plain FSDP2: the checkpoint reshards). ep = tp = 2 joins the tp2 launch.
EP = ["backend=fsdp2", "backend.ep=2"]
EP_SAVED = [*PARITY, "trainer.max_steps=4", "trainer.save_every_n_steps=2", *EP]
HEAD_RUNS = {"dp1": [("sft_off", "sft", ["model.fused_loss=off"]), ("dpo_off", "dpo", ["model.fused_loss=off"])],
             "tp2": [("sft", "sft", ["backend=fsdp2_tp", "model.fused_loss=chunked"]),
                     ("dpo", "dpo", ["backend=fsdp2_tp", "model.fused_loss=chunked"]),
                     ("sft_off", "sft", ["backend=fsdp2_tp", "model.fused_loss=off"])]}


def _launch(root: Path, name: str, runs: list[dict], nproc: int = 1) -> tuple[subprocess.Popen, list[dict]]:
    return start_batch(root, name, runs, nproc), runs


def _finish(processes: dict[str, tuple[subprocess.Popen, list[dict]]]) -> dict[str, str]:
    """Each launch's output followed by its runs' own (batch_log)."""
    return {name: p.communicate(timeout=600)[0] + "".join(batch_log(Path(r["out"])) for r in runs)
            for name, (p, runs) in processes.items()}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, family_args, families) -> tuple[Path, dict[str, str]]:
    """Each family's three stages in one process; two processes at a time (one per CPU core). -> (root, logs)."""
    root, logs, running = tmp_path_factory.mktemp("families"), {}, {}
    for family in families["all"]:
        runs = [{"out": str(root / family / stage), "args": [*args, *family_args(family), *QUIET]}
                for stage, args in STAGES.items()]
        running[family] = _launch(root, family, runs)
        if len(running) == 2:
            logs.update(_finish(running))
            running = {}
    logs.update(_finish(running))
    return root, logs


@pytest.fixture(scope="module")
def parity(tmp_path_factory, family_args, families) -> tuple[Path, dict[str, str]]:
    """One 2-rank launch per backend, each running the four parity families' SFT one after the other."""
    root, logs = tmp_path_factory.mktemp("family_parity"), {}
    for backend, extra in BACKENDS.items():
        runs = [{"out": str(root / backend / family), "args": [*PARITY, *family_args(family), *extra]}
                for family in families["parity"]]
        logs.update(_finish({backend: _launch(root, backend, runs, nproc=2)}))
    return root, logs


@pytest.fixture(scope="module")
def tp_parity(tmp_path_factory, family_args, families) -> tuple[Path, dict[str, str]]:
    """One launch per layout (TP_LAYOUTS), each running every TP family's SFT one after the other, then HEAD_RUNS."""
    root, logs = tmp_path_factory.mktemp("family_tp"), {}
    for layout, (nproc, extra) in TP_LAYOUTS.items():
        runs = [{"out": str(root / layout / family), "args": [*PARITY, *family_args(family), *extra]}
                for family in families["tp"]]
        runs += [{"out": str(root / layout / f"head_{name}"),
                  "args": [*HEAD_STAGES[stage], *family_args("llama"), *HEAD_STEP, *overrides]}
                 for name, stage, overrides in HEAD_RUNS[layout]]
        if layout == "tp2":  # ep = tp = 2: attention split by tp, experts by ep (parallel/ep.py)
            runs += [{"out": str(root / layout / f"{family}_ep2"), "args": [*PARITY, *family_args(family), *extra,
                                                                            "backend.ep=2"]}
                     for family in families["moe"]]
        logs.update(_finish({layout: _launch(root, layout, runs, nproc=nproc)}))
    return root, logs


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory, family_args, families) -> tuple[Path, str]:
    """One 2-rank launch: EP (above) for every EP family, Qwen2-MoE's DDP reference, Mixtral's save and resumes."""
    root = tmp_path_factory.mktemp("family_ep")
    saved = root / "mixtral_saved"
    runs = [{"out": str(root / family), "args": [*PARITY, *family_args(family), *EP]} for family in families["ep"]]
    runs += [{"out": str(root / "qwen2_moe_ddp"), "args": [*PARITY, *family_args("qwen2_moe")]},
             {"out": str(saved), "args": [*EP_SAVED, *family_args("mixtral")]},
             {"out": str(root / "mixtral_resumed"),
              "args": [*EP_SAVED, *family_args("mixtral"), f"resume={saved}/checkpoints/step_2"]},
             {"out": str(root / "mixtral_live"), "args": [*PARITY, *family_args("mixtral"), *EP,
                                                          "trainer.grad_accum_steps=1", "trainer.micro_batch_size=4"]},
             {"out": str(root / "mixtral_resumed_ep1"),
              "args": [*EP_SAVED, *family_args("mixtral"), f"resume={saved}/checkpoints/step_2", "backend.ep=1"]}]
    return root, _finish({"ep": _launch(root, "ep", runs, nproc=2)})["ep"]


def _records(run_dir: Path, log: str) -> list[dict]:
    """The finished run's metrics records; LOG (its launch's output) shown if the run never started."""
    assert any(run_dir.parent.glob(f"{run_dir.name}.rank*.log")), f"{run_dir} never started:\n{log[-4000:]}"
    return read_metrics(assert_batch_ok(run_dir))[0]


def test_every_stage_trains(matrix, family, families):
    """SFT (packed rows), DPO and GRPO: 2 finite steps and an export transformers loads; DPO starts at ln 2 (policy
    and reference built from one seed); an MoE model's SFT, DPO and GRPO (the actor's update) add and log its router
    aux loss, a dense one's none; what the family needed is said in the log (Gemma-2: eager attention; Phi-3: its
    pad id)."""
    from transformers import AutoModelForCausalLM

    root, logs = matrix
    for stage in STAGES:
        records = _records(root / family / stage, logs[family])
        assert [r["step"] for r in records] == [1, 2], stage
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records), (stage, records)
        assert (root / family / stage / "hf" / "config.json").exists()
    sft = read_metrics(root / family / "sft")[0]
    if family in families["moe"]:  # two experts of four per token: balanced routing gives aux = 2
        assert all(1.5 < r["aux_loss"] < 4 and 1 <= r["expert_load_max"] <= 4 for r in sft), sft
    else:
        assert not any("aux_loss" in r for r in sft)
    model = AutoModelForCausalLM.from_pretrained(root / family / "sft" / "hf")
    dpo = read_metrics(root / family / "dpo")[0][0]  # with an MoE model's coef × aux loss on top
    coef = getattr(model.config, "router_aux_loss_coef", 0.0) if family in families["moe"] else 0.0
    assert abs(dpo["loss"] - coef * dpo.get("aux_loss", 0.0) - math.log(2)) < 1e-6, dpo
    assert ("aux_loss" in dpo) == (family in families["moe"])
    grpo = read_metrics(root / family / "grpo")[0]
    assert all(("aux_loss" in r) == (family in families["moe"]) for r in grpo), grpo
    assert model.config.model_type == family and model.config.pad_token_id < model.config.vocab_size
    if family == "gemma2":
        assert "Gemma2ForCausalLM has no sdpa_segments in transformers (_supports_sdpa): eager" in logs[family]
    if family == "phi3":
        assert "its default pad_token_id=32000 lies outside vocab_size=263: set to 257" in logs[family]


@pytest.mark.parametrize("backend", ["zero3", "fsdp2"])
def test_parity_with_ddp(parity, parity_family, backend, families, assert_close_series):
    """3 SFT steps of packed rows, micro 2 × accumulation 2 × 2 ranks, fp32: the same per-step loss (with the MoE aux
    term), grad norm and aux loss as DDP, 1e-5 relative."""
    root, logs = parity
    family = parity_family
    reference, ours = _records(root / "ddp" / family, logs["ddp"]), _records(root / backend / family, logs[backend])
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    for key in ("loss", "grad_norm", *(("aux_loss",) if family in families["moe"] else ())):
        assert_close_series(ours, reference, key, 1e-5, 1e-5)


def test_tensor_parallel_parity(tp_parity, tp_family, families, assert_close_series):
    """dp 1 × tp 2 with the family's own TP plan (q/k norms with their gradient summed over tp, Phi-3's gathered
    fused projections, experts split over tp) trains 3 SFT steps as one process does: loss, grad norm and aux
    loss within 1e-5 relative; the log names the styles applied."""
    root, logs = tp_parity
    reference, ours = _records(root / "dp1" / tp_family, logs["dp1"]), _records(root / "tp2" / tp_family, logs["tp2"])
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    for key in ("loss", "grad_norm", *(("aux_loss",) if tp_family in families["moe"] else ())):
        assert_close_series(ours, reference, key, 1e-5, 1e-5)
    styles = {"qwen3": "replicated_with_grad_allreduce × 4", "gemma3_text": "replicated_with_grad_allreduce × 4",
              "phi3": "colwise_gather_output × 4", "mixtral": "moe_tp_experts × 2",
              "qwen3_moe": "moe_tp_experts × 2"}
    assert f"tp=2 {tp_family}: " in logs["tp2"] and styles.get(tp_family, "rowwise × 4") in logs["tp2"]


@pytest.mark.parametrize("stage,tp_run", [("sft", "sft"), ("dpo", "dpo"), ("sft", "sft_off")])
def test_vocab_sharded_head_equals_full_logits(tp_parity, stage, tp_run):
    """One step on dp 1 × tp 2 with the fused head split over the vocabulary (and, sft_off, with the head replicated
    and full logits) equals one process's full logits (model.fused_loss=off): loss and grad norm within 1e-6
    relative, every exported weight within 1e-6 of its tensor's largest entry (HEAD_RUNS says why Adam's eps is 1)."""
    from safetensors.torch import load_file

    root, logs = tp_parity
    reference_dir, ours_dir = root / "dp1" / f"head_{stage}_off", root / "tp2" / f"head_{tp_run}"
    (reference,), (ours,) = _records(reference_dir, logs["dp1"]), _records(ours_dir, logs["tp2"])
    for key in ("loss", "grad_norm"):
        assert abs(ours[key] - reference[key]) <= 1e-6 * abs(reference[key]), (key, ours[key], reference[key])
    expected, trained = load_file(reference_dir / "hf" / "model.safetensors"), load_file(ours_dir / "hf" /
                                                                                          "model.safetensors")
    assert trained.keys() == expected.keys()
    for name, tensor in expected.items():
        assert (trained[name] - tensor).abs().max() <= 1e-6 * tensor.abs().max(), name
    sharded = "LM head split over the vocabulary, 132 of 263 rows per rank" in logs["tp2"]
    assert sharded and "LM head and loss: full (tokens, V) logits (model.fused_loss=off)" in logs["tp2"]


def test_expert_parallel_equals_ddp(expert_parallel, parity, expert_family, families, assert_close_series):
    """fsdp2 with backend.ep=2 (each rank 2 of 4 experts, dp 2) trains 3 SFT steps as DDP on 2 ranks does on the same
    global batch: loss, grad norm and the router's aux loss within 1e-5 relative, the busiest expert's load equal
    (routing is per token, on each rank's own rows in both); Qwen2-MoE with its shared expert too."""
    root, log = expert_parallel
    ddp_dir, ddp_log = (root / "qwen2_moe_ddp", log) if expert_family == "qwen2_moe" else \
        (parity[0] / "ddp" / expert_family, parity[1]["ddp"])
    reference, ours = _records(ddp_dir, ddp_log), _records(root / expert_family, log)
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    for key in ("loss", "grad_norm", "aux_loss", "expert_load_max"):
        assert_close_series(ours, reference, key, 1e-5, 1e-5)
    assert "ep 2: 2 experts modules split, 2 of 4 experts per rank, sharded over efsdp 1" in log


def test_expert_parallel_beside_tensor_parallel(tp_parity, families, assert_close_series):
    """ep = tp = 2 (dp 1): attention split by tp, the experts by ep (out of tp's plan), each tp peer dispatching half of
    the shared rows: the one-process run's loss, grad norm and aux loss within 1e-5 relative."""
    root, logs = tp_parity
    for family in families["moe"]:
        reference, ours = _records(root / "dp1" / family, logs["dp1"]), _records(root / "tp2" / f"{family}_ep2",
                                                                                 logs["tp2"])
        for key in ("loss", "grad_norm", "aux_loss"):
            assert_close_series(ours, reference, key, 1e-5, 1e-5)


def test_expert_parallel_resumes_bitwise_and_reshards_to_ep1(expert_parallel, assert_close_series):
    """Mixtral at ep 2, saved at step 2 of 4: resumed at ep 2, steps 3-4 bit for bit; resumed at ep 1 (the experts
    whole on every rank, FSDP over dp: the checkpoint reshards) within 1e-5, and its HF export equals the ep 2 run's
    within 1e-5 of each tensor's scale (the same model, two layouts)."""
    from safetensors.torch import load_file

    root, log = expert_parallel
    straight, resumed, as_ep1 = (_records(root / name, log) for name in ("mixtral_saved", "mixtral_resumed",
                                                                        "mixtral_resumed_ep1"))
    keys = ("loss", "grad_norm", "aux_loss")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in straight[2:]]
    for key in keys:
        assert_close_series(as_ep1, straight[2:], key, 1e-5, 1e-5)
    expected = load_file(root / "mixtral_saved" / "hf" / "model.safetensors")
    exported = load_file(root / "mixtral_resumed_ep1" / "hf" / "model.safetensors")
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert (exported[name] - tensor).abs().max() <= 1e-5 * tensor.abs().max(), name


def test_expert_parallel_live_cost_matches_the_plan(expert_parallel, assert_live_cost_matches_the_plan):
    """Mixtral at ep 2 (no accumulation, so the ledger's states are the plan's): each rank's model states (the dense
    weights FSDP-sharded over 2, its 2 of 4 experts whole: E/ep), activations and every counted collective, the
    experts' all-to-all apart, against the planner's figures (conftest: 5 % per kind, 25 % activations). The
    all-to-all: what a rank receives follows the router, so the ranks' mean, within 20 % below the plan (rows of
    max_seq_len; a batch's packed rows may be shorter), as sp's all-to-all is checked."""
    root, _ = expert_parallel
    errors = assert_live_cost_matches_the_plan(root / "mixtral_live", ranks=2, states=True, routed=("all_to_all",),
                                               activations=False)
    assert abs(errors["states"]) <= 0.05 and abs(errors["activations"]) <= 0.5, errors
    second = read_metrics(root / "mixtral_live")[0][1]
    planned, counted = second["plan_comm_all_to_all_payload"], [second[f"comm_r{r}_all_to_all_payload"] for r in (0, 1)]
    assert all(c > 0 for c in counted) and 0.8 * planned <= sum(counted) / 2 <= planned, (counted, planned)
