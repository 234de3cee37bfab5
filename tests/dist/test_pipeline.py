"""Pipeline parallelism (backend.pp=2) under torchrun (gloo, fp32) against one process, the same global batch:
a 4-block tiny Llama from config (every rank builds it from the seed, as one process does), micro-batch 2 × M = 4
micro-batches per pipeline, 6 steps, gradient clipping at 1.0 active (grad norms ~5), saved at step 3, evaluated at
steps 0, 3 and 6 (256 held-out examples in batches of 48: the last, of 16 rows, is padded to the stages' 48).

- parity: loss AND grad norm of every step within 1e-5 relative of one process (the first within 1e-6) for 1f1b,
  interleaved_1f1b (v=2: 4 stages on 2 ranks) and zbv (the V: rank 0 stages 0 and 3), unpacked SFT; gpipe on packed
  rows against a packed run; dp 2 × pp 2 on 4 ranks under zb (v=1; micro-batch 1, so the global batch stays 8;
  FSDP2 shards each stage over its dp pair, its gradients reduce-scattered after the split backward's weight passes;
  with blocks resharded after forward, the default, zb lost their weight gradients: step 1's grad norm 5.985 against
  7.534);
  pp 2 × tp 2 on 4 ranks (TP on each stage, then FSDP); tied embeddings (a copy on each end stage, gradients
  summed), and a one-process tied checkpoint (the weight and its Adam state once) resumed at pp=2.
- p2p: the bytes each rank hands to isend in steps 1 and 2 (metrics/comm.py counts them) are the planner's
  (plan.pp.pipeline_p2p: hidden states forward, gradients back) plus the micro-batch index (b int64) each forward send
  carries, for 1f1b, interleaved (4 stages on 2 ranks) and the reward model's packed pair rows.
- LoRA (peft=lora, 1f1b): equal to one process with LoRA, bitwise on resume, its checkpoint the adapters only, its
  `adapter/` and merged `hf/` exports one process's, its planned states per rank (frozen base, trained adapters) the
  ledger's.
- resume: a pp=2 checkpoint resumed at pp=2 is bitwise; resumed in one process (pp2 → 1) and a one-process checkpoint
  resumed at pp=2 (1 → pp2) continue within the parity tolerance (DCP keys are the whole model's).
- the split is logged per stage, and the `hf/` export is the whole model (every key), loadable, equal to the
  one-process run's export to 1e-5.
- eval: loss, accuracy and token count computed on the last stage reach rank 0's metrics.jsonl, equal to one
  process's (loss 1e-6 relative at step 0, 1e-5 after).
- pairs (the saved 2-block tiny Llama, one block per stage; 4 steps of 8 pairs: micro 2 pairs × M 4; eval of 32
  held-out pairs at steps 0, 2, 4): the reward model under 1f1b and DPO under gpipe (its reference log-probs computed
  through the policy's own pipeline before step 1, against one process's frozen reference engine precomputing them)
  equal one process on loss, grad norm and the stage's metrics (accuracy, margins, eval) within 1e-5; DPO's step-1
  rewards are exactly 0 (the precomputed reference IS the policy's first forward); a DPO pp=2 checkpoint resumes
  bitwise. ORPO (1f1b: its NLL over the chosen tokens and its odds-ratio term over the pairs, two normalisers) too, and
  DPO on dp 2 × pp 2 (4 ranks, 1f1b, micro-batch 1 pair: the global batch stays 8; ~58 s a launch on a loaded 2-core
  machine, the 2-rank DPO run 38 s at the same time).
  The pp=2 reward model's `hf/` export is the whole sequence classifier (score head included), equal to one process's.
- live memory (steps 1-2, every rank its own): the saved tensors alive at once over the micro-batches in flight, within
  15 % of the pp rank's plan, with the plan's chunks in flight (gpipe 4, 1f1b 2 and 1, interleaved 5 and 3); the
  planned model states per pp rank (first and last differ) equal each rank's ledger and the planner's lines.
Every run of the module runs once, before its tests, several per launch (tests/dist/workers/batched_runs.py): one
launch per process count (1, 2, 4 ranks), and a second one-process launch for the run resumed from a pp=2 checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers import REPO, BatchedRuns, read_metrics

pytestmark = pytest.mark.dist

BASE = ["recipe=sft_tiny", "model.from_config.num_hidden_layers=4", "trainer.eval_every_n_steps=3",
        "trainer.eval_batch_size=48", "trainer.log_every_n_steps=0", "optim.lr=1e-3", "optim.warmup_steps=2",
        "trainer.max_steps=6", "trainer.save_every_n_steps=3", "trainer.keep_last_k=3", "trainer.micro_batch_size=2",
        "trainer.grad_accum_steps=4"]
PP = ["backend=fsdp2", "backend.pp=2"]
PEAK_TFLOPS = 0.01  # a stated peak: these runs log MFU against it (a CPU has none of its own)
ZERO_BUBBLE = ["backend.pp_virtual_stages=2", "backend.reshard_after_forward=false"]
# name: (processes, overrides)
RUNS = {
    "one": (1, ["backend=fsdp2"]),
    "zbv": (2, [*PP, *ZERO_BUBBLE, "backend.pp_schedule=zbv"]),
    "1f1b": (2, [*PP, "backend.pp_schedule=1f1b", f"plan.peak_tflops={PEAK_TFLOPS}"]),
    "interleaved": (2, [*PP, "backend.pp_schedule=interleaved_1f1b", "backend.pp_virtual_stages=2"]),
    "one_packed": (1, ["backend=fsdp2", "data.packing=true"]),
    "gpipe_packed": (2, [*PP, "backend.pp_schedule=gpipe", "data.packing=true"]),
    "dp2_pp2": (4, [*PP, "backend.pp_schedule=zb", "backend.reshard_after_forward=false",  # ZB1P: one stage a rank
                    "trainer.micro_batch_size=1"]),  # micro 1 × M 4 × dp 2 = 8
    "pp2_tp2": (4, [*PP, "backend.pp_schedule=1f1b", "backend.tp=2",  # tp peers share examples: dp 1, batch 8
                    f"plan.peak_tflops={PEAK_TFLOPS}"]),
    "one_tied": (1, ["backend=fsdp2", "model.from_config.tie_word_embeddings=true"]),
    "1f1b_tied": (2, [*PP, "backend.pp_schedule=1f1b", "model.from_config.tie_word_embeddings=true"]),
    "one_lora": (1, ["backend=fsdp2", "peft=lora"]),
    "1f1b_lora": (2, [*PP, "backend.pp_schedule=1f1b", "peft=lora"]),
}


DATA = REPO / "llmtrain" / "assets" / "data"
PAIRS = ["trainer.max_steps=4", "trainer.micro_batch_size=2", "trainer.grad_accum_steps=4",
         "trainer.save_every_n_steps=2", "trainer.keep_last_k=2", "trainer.eval_every_n_steps=2",
         "trainer.eval_batch_size=16", "trainer.log_every_n_steps=0", "optim.lr=1e-3", "optim.warmup_steps=2",
         "optim.weight_decay=0.1", "model.from_config=null", "model.tokenizer=null", "backend=fsdp2"]
DPO = ["recipe=dpo_tiny", "dpo.beta=0.5", "dpo.precompute_ref_logps=true"]
KTO = ["recipe=kto_tiny", "kto.beta=0.5", "kto.precompute_ref_logps=true"]  # 8 completions a step (the pairs unpaired)
# name: (processes, overrides), each after PAIRS, the saved model and the held-out pairs
PAIR_RUNS = {
    "rm_one": (1, ["recipe=rm_tiny"]),
    "rm_1f1b": (2, ["recipe=rm_tiny", *PP, "backend.pp_schedule=1f1b"]),
    "dpo_one": (1, DPO),
    "dpo_gpipe": (2, [*DPO, *PP, "backend.pp_schedule=gpipe"]),
    "dpo_dp2_pp2": (4, [*DPO, *PP, "backend.pp_schedule=1f1b", "trainer.micro_batch_size=1"]),  # 1 × M 4 × dp 2 = 8
    "orpo_one": (1, ["recipe=orpo_tiny"]),
    "orpo_1f1b": (2, ["recipe=orpo_tiny", *PP, "backend.pp_schedule=1f1b"]),
    "kto_one": (1, KTO),
    "kto_gpipe": (2, [*KTO, *PP, "backend.pp_schedule=gpipe"]),
}


# resumed runs: name -> (the run whose settings it takes, the run whose checkpoint it loads, the checkpoint's step)
RESUMED = {"1f1b_resumed": ("1f1b", "1f1b", 3), "one_from_1f1b": ("one", "1f1b", 3),
           "1f1b_from_one": ("1f1b", "one", 3), "1f1b_tied_from_one_tied": ("1f1b_tied", "one_tied", 3),
           "dpo_gpipe_resumed": ("dpo_gpipe", "dpo_gpipe", 2), "1f1b_lora_resumed": ("1f1b_lora", "1f1b_lora", 3)}


def _head(root: Path, name: str, lines: int) -> Path:
    """The first `lines` examples of a shipped data file."""
    path = root / name
    path.write_text("".join((DATA / name).read_text().splitlines(True)[:lines]))
    return path


def _all_runs(root: Path, model_dir: Path) -> dict[str, tuple[int, list[str]]]:
    """name -> (processes, arguments) of every run of the module (RUNS, PAIR_RUNS, then RESUMED)."""
    # 64 training pairs (4 steps use 32) and 32 held-out ones: DPO's reference pass over all of them before step 1
    # and the evals run through the stages without dominating the run
    train, held_out = _head(root, "reverse_prefs_train.jsonl", 64), _head(root, "reverse_prefs_eval.jsonl", 32)
    pairs = [f"model.name_or_path={model_dir}", f"data.train_files=[{train}]", f"data.eval_files=[{held_out}]"]
    runs = {name: (processes, [*BASE, *overrides]) for name, (processes, overrides) in RUNS.items()}
    runs.update({name: (processes, [*PAIRS, *overrides, *pairs]) for name, (processes, overrides) in PAIR_RUNS.items()})
    for name, (settings, source, step) in RESUMED.items():
        processes, args = runs[settings]
        runs[name] = (processes, [*args, f"resume={root / source}/checkpoints/step_{step}"])
    return runs


def _launches(runs: dict[str, tuple[int, list[str]]]) -> list[tuple[int, list[str]]]:
    """(processes, run names) per launch: one per process count, a resumed run after the run it loads; a run whose
    checkpoint comes from a later launch (one_from_1f1b) waits for a second launch of its count."""
    launches, done, pending = [], set(), list(runs)
    while pending:
        for processes in sorted({runs[name][0] for name in pending}):
            batch = []
            for name in pending:
                source = RESUMED.get(name, (None, None))[1]
                if runs[name][0] == processes and (source is None or source in done or source in batch):
                    batch.append(name)
            if batch:
                launches.append((processes, batch))
                done.update(batch)
                pending = [name for name in pending if name not in done]
    return launches


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> BatchedRuns:
    """All the module's runs, several per launch: 4 launches instead of 22."""
    root = tmp_path_factory.mktemp("pp_runs")
    spec = _all_runs(root, tiny_model_dir)
    return BatchedRuns(root, [(processes, [(name, spec[name][1]) for name in names])
                              for processes, names in _launches(spec)])


def assert_parity(ours: list[dict], reference: list[dict], assert_close_series) -> None:
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]  # the same examples
    assert_close_series(ours, reference, "loss", 1e-6, 1e-5)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]


@pytest.mark.parametrize("name,reference", [("zbv", "one"), ("1f1b", "one"), ("interleaved", "one"),
                                            ("gpipe_packed", "one_packed"), ("dp2_pp2", "one"),
                                            ("1f1b_tied", "one_tied"), ("pp2_tp2", "one"),
                                            ("1f1b_lora", "one_lora")])
def test_pp2_equals_one_process(runs, name, reference, assert_close_series):
    assert_parity(read_metrics(runs(name))[0], read_metrics(runs(reference))[0], assert_close_series)


@pytest.mark.parametrize("name,reference", [("1f1b", "one"), ("interleaved", "one"), ("gpipe_packed", "one_packed"),
                                            ("dp2_pp2", "one"), ("zbv", "one")])
def test_eval_through_the_pipeline_equals_one_process(runs, name, reference, assert_close_series):
    ours, theirs = read_metrics(runs(name))[1], read_metrics(runs(reference))[1]
    assert [r["step"] for r in ours] == [0, 3, 6] == [r["step"] for r in theirs]
    assert [(r["eval_tokens"], r["eval_accuracy"]) for r in ours] == [(r["eval_tokens"], r["eval_accuracy"])
                                                                      for r in theirs]
    assert_close_series(ours, theirs, "eval_loss", 1e-6, 1e-5)


def test_split_is_logged(runs):
    runs("1f1b")
    assert "pp rank 0: stage 0: embed + blocks 0-1" in runs.log("1f1b")
    assert "pp rank 1: stage 1: blocks 2-3 + norm + head" in runs.log("1f1b")
    runs("interleaved")
    for line in ("pp rank 0: stage 0: embed + block 0", "pp rank 1: stage 1: block 1", "pp rank 0: stage 2: block 2",
                 "pp rank 1: stage 3: block 3 + norm + head"):
        assert line in runs.log("interleaved")
    runs("zbv")
    assert "pp rank 1: stage 2: block 2" in runs.log("zbv") and "pp rank 0: stage 3: block 3 + norm + head" in \
        runs.log("zbv")


@pytest.mark.parametrize("name", ["1f1b", "1f1b_lora"])
def test_bitwise_resume_at_pp2(runs, name):
    straight, resumed = runs(name), runs(f"{name}_resumed")  # from straight's step 3 (RESUMED)
    continued, reference = read_metrics(resumed)[0], read_metrics(straight)[0][3:]
    assert [r["step"] for r in continued] == [4, 5, 6]
    assert [(r["loss"], r["grad_norm"]) for r in continued] == [(r["loss"], r["grad_norm"]) for r in reference]


@pytest.mark.parametrize("source,name", [("1f1b", "one"), ("one", "1f1b"), ("one_tied", "1f1b_tied")])
def test_checkpoints_reshard_between_pp2_and_one_process(runs, source, name, assert_close_series):
    straight, resumed = runs(source), runs(f"{name}_from_{source}")  # from straight's step 3 (RESUMED)
    continued = read_metrics(resumed)[0]
    assert [r["step"] for r in continued] == [4, 5, 6]
    assert_close_series(continued, read_metrics(straight)[0][3:], "loss", 1e-5, 1e-5)
    assert_close_series(continued, read_metrics(straight)[0][3:], "grad_norm", 1e-5, 1e-5)


def test_hf_export_is_the_whole_model(runs):
    import torch
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(runs("1f1b") / "hf").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(runs("one") / "hf").state_dict()
    assert sorted(ours) == sorted(reference) and any(".layers.3." in key for key in ours)
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-5, msg=key)


def test_lora_at_pp2_saves_adapters_only_and_exports_as_one_process(runs):
    """peft=lora over 2 stages: the checkpoint holds the adapters (and their Adam state) only, the base is rebuilt
    from its source on resume; the export is one process's: `adapter/` (peft format, each stage's adapters gathered
    to rank 0) and the merged `hf/`, to 1e-5."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    run, reference = runs("1f1b_lora"), runs("one_lora")
    saved = FileSystemReader(str(run / "checkpoints" / "step_3" / "engines" / "policy" / "dcp")).read_metadata()
    saved = saved.state_dict_metadata
    model_keys = [key for key in saved if key.startswith("model.")]
    assert model_keys and all("lora_" in key for key in model_keys), model_keys[:4]
    assert any(".layers.0." in key for key in model_keys) and any(".layers.3." in key for key in model_keys)
    ours, theirs = (load_file(r / "adapter" / "adapter_model.safetensors") for r in (run, reference))
    assert sorted(ours) == sorted(theirs) and any("lora_B" in key and ours[key].abs().max() > 0 for key in ours)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-5, msg=key)
    merged = AutoModelForCausalLM.from_pretrained(run / "hf").state_dict()
    for key, value in AutoModelForCausalLM.from_pretrained(reference / "hf").state_dict().items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("name,peers", [("1f1b", 2), ("pp2_tp2", 4)])
def test_mfu_counts_each_ranks_share_of_a_tokens_flops(runs, name, peers):
    """Rank 0 (pp rank 0) sees each micro-batch once but computes only its stage of it, and under tp half of that:
    its MFU is its tokens × (6·M + 12·L·h·s) / (tp·pp) over step time × the stated peak, not the whole model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.compose import compose_config

    run = runs(name)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(run / "hf").parameters())
    config = AutoConfig.from_pretrained(run / "hf")
    seq = compose_config([*BASE, *RUNS[name][1]]).data.max_seq_len
    flops = 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq
    for record in read_metrics(run)[0][:2]:
        tokens = 4 * record["memory_r0_activation_rows"] * record["memory_r0_activation_seq"]  # M = 4, one shape
        expected = tokens * flops / peers / (record["step_time_s"] * PEAK_TFLOPS * 1e12)
        assert record["mfu"] == pytest.approx(expected, rel=1e-9), (record["mfu"], expected)


# ---- pairs: the reward model and DPO -------------------------------------------------------------------------------

PAIR_METRICS = {"rm": ("accuracy", "margin", "reward_chosen", "reward_rejected"),
                "dpo": ("reward_accuracy", "reward_margin", "logp_chosen", "logp_rejected"),
                "orpo": ("reward_accuracy", "reward_margin", "nll_loss", "log_odds_ratio"),
                "kto": ("reward_margin", "logp_chosen", "logp_rejected", "kl")}
PAIR_EVAL = {"rm": ("eval_loss", "eval_margin", "eval_reward_mean", "eval_reward_std"),
             "dpo": ("eval_loss", "eval_reward_margin"), "orpo": ("eval_loss", "eval_nll_loss", "eval_reward_margin"),
             "kto": ("eval_loss", "eval_reward_margin", "eval_kl")}


@pytest.mark.parametrize("name,reference", [("rm_1f1b", "rm_one"), ("dpo_gpipe", "dpo_one"), ("orpo_1f1b", "orpo_one"),
                                            ("dpo_dp2_pp2", "dpo_one"), ("kto_gpipe", "kto_one")])
def test_pair_stages_through_the_pipeline_equal_one_process(runs, name, reference, assert_close_series):
    (ours, our_evals), (theirs, their_evals) = read_metrics(runs(name)), read_metrics(runs(reference))
    stage = name.split("_")[0]
    counted = "completions" if stage == "kto" else "pairs"
    assert [r["step"] for r in ours] == [1, 2, 3, 4] and [r[counted] for r in ours] == [8] * 4
    assert_close_series(ours, theirs, "loss", 1e-6, 1e-5)
    assert_close_series(ours, theirs, "grad_norm", 1e-6, 1e-5)
    for key in PAIR_METRICS[stage]:  # computed on the last stage, in rank 0's metrics.jsonl
        assert_close_series(ours, theirs, key, 1e-5, 1e-5, atol=1e-6)
    assert [r["step"] for r in our_evals] == [0, 2, 4] == [r["step"] for r in their_evals]
    assert [r["eval_pairs"] for r in our_evals] == [32] * 3
    for key in PAIR_EVAL[stage]:
        assert_close_series(our_evals, their_evals, key, 1e-5, 1e-5, atol=1e-6)
    assert theirs[-1]["loss"] != theirs[0]["loss"]


def test_dpo_reference_comes_from_the_policys_own_pipeline(runs):
    """The reference log-probs, precomputed through the stages before step 1, equal the policy's first training
    forward bit for bit: step 1's rewards are exactly 0 and its loss is ln 2 (in float32)."""
    run = runs("dpo_gpipe")
    first = read_metrics(run)[0][0]
    assert (first["reward_chosen"], first["reward_rejected"], first["reward_margin"]) == (0.0, 0.0, 0.0)
    assert abs(first["loss"] - math.log(2)) < 1e-7
    assert (run / "ref_logps.pt").is_file() and "the reference role is released" in runs.log("dpo_gpipe")


def test_dpo_bitwise_resume_at_pp2(runs):
    straight, resumed = runs("dpo_gpipe"), runs("dpo_gpipe_resumed")  # from straight's step 2 (RESUMED)
    continued, reference = read_metrics(resumed)[0], read_metrics(straight)[0][2:]
    assert [r["step"] for r in continued] == [3, 4]
    assert [(r["loss"], r["grad_norm"], r["reward_margin"]) for r in continued] == \
        [(r["loss"], r["grad_norm"], r["reward_margin"]) for r in reference]


# ---- the live cost's p2p bytes next to the planner's ---------------------------------------------------------------

# run -> (forward sends per rank in a step: each carries the micro-batch index too, rows of the stage buffers)
P2P = {"1f1b": ([4, 0], 2), "interleaved": ([8, 4], 2), "rm_1f1b": ([4, 0], 1)}


@pytest.mark.parametrize("name", list(P2P))
def test_counted_p2p_bytes_are_the_planners(runs, name):
    run = runs(name)
    forward_sends, rows = P2P[name]
    for record in read_metrics(run)[0][:2]:
        plan = record["plan_comm_p2p_payload"]
        assert plan > 0 and record["plan_comm_p2p_wire"] == plan
        counted = [record[f"comm_r{rank}_p2p_payload"] for rank in range(2)]
        assert counted == [plan + sends * rows * 8 for sends in forward_sends]  # the busiest rank's figure, exactly


def test_reward_model_export_is_the_whole_sequence_classifier(runs):
    """The pp=2 reward model's `hf/` (each stage's tensors gathered to rank 0, the score head from the last stage)
    loads as the one-process export, to 1e-5, with the eval's reward statistics in its config."""
    import torch
    from transformers import AutoModelForSequenceClassification

    ours = AutoModelForSequenceClassification.from_pretrained(runs("rm_1f1b") / "hf")
    theirs = AutoModelForSequenceClassification.from_pretrained(runs("rm_one") / "hf")
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict()) and "score.weight" in ours.state_dict()
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=0, atol=1e-5, msg=key)
    assert abs(ours.config.reward_mean - theirs.config.reward_mean) <= 1e-5 * abs(theirs.config.reward_mean) + 1e-7


# ---- the live cost's memory figures: each rank's own ---------------------------------------------------------------

GIB = 1024**3
# run -> (chunks in flight at each rank's peak, the micro-batch's rows): GPipe holds all M = 4 forwards, 1F1B P − pp
# rank, interleaved torch's warm-up ((v−1)·P + 2·(P−1−r) + 1); on 4 ranks pp is the outer dimension (ranks 0, 1: pp 0)
IN_FLIGHT = {"1f1b": ([2, 1], 2), "interleaved": ([5, 3], 2), "gpipe_packed": ([4, 4], 2), "pp2_tp2": ([2, 2, 1, 1], 2),
             "rm_1f1b": ([2, 1], 1), "dpo_gpipe": ([4, 4], 1), "dpo_dp2_pp2": ([2, 2, 1, 1], 1)}  # pairs: one row
# zero-bubble runs -> (ranks, chunks planned: the bound, every chunk of the step: zb M = 4, zbv 2 stages × 4)
ZERO_BUBBLE_RUNS = {"dp2_pp2": (4, 4), "zbv": (2, 8)}


@pytest.mark.parametrize("name", list(IN_FLIGHT))
def test_live_activations_are_each_pp_ranks_own(runs, name):
    """Steps 1-2: every rank measures its own stages (metrics/live.InFlightMeter: saved tensors alive at once over its
    micro-batches in flight), > 0 and within 15 % of its pp rank's plan at the micro-batch's shape (measured −5.3 %
    to +9.1 %, the packed pair rows' first stage the highest); the chunks in flight at the measured peak are the
    plan's, and the schedules differ as they should."""
    run = runs(name)
    chunks, rows = IN_FLIGHT[name]
    for record in read_metrics(run)[0][:2]:
        for rank, planned_chunks in enumerate(chunks):
            measured, planned = record[f"memory_r{rank}_activations"], record[f"memory_r{rank}_plan_activations"]
            assert measured > 0 and abs(measured / planned - 1) <= 0.15, (rank, measured, planned)
            assert record[f"memory_r{rank}_in_flight"] == record[f"memory_r{rank}_plan_in_flight"] == planned_chunks
            assert record[f"memory_r{rank}_activation_rows"] == rows and record[f"memory_r{rank}_activation_seq"] > 0
        assert record["plan_memory_activations"] == record["memory_r0_plan_activations"]


@pytest.mark.parametrize("name", list(ZERO_BUBBLE_RUNS))
def test_zero_bubble_live_activations_stay_under_the_planned_bound(runs, name):
    """zb and zbv: torch's split backward keeps part of each chunk's graph past its weight pass, so the plan counts
    every chunk of the step; each rank measures no more than that bound, and not far under it (measured 51-77 % of
    it; under zb all 4 of the last stage's chunks alive at once)."""
    ranks, chunks = ZERO_BUBBLE_RUNS[name]
    for record in read_metrics(runs(name))[0][:2]:
        for rank in range(ranks):
            measured, bound = record[f"memory_r{rank}_activations"], record[f"memory_r{rank}_plan_activations"]
            assert 0.4 * bound < measured <= bound, (rank, measured, bound)
            assert record[f"memory_r{rank}_in_flight"] <= record[f"memory_r{rank}_plan_in_flight"] == chunks, rank


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "pp2_tp2", "rm_1f1b", "1f1b_lora"])
def test_plan_state_is_each_pp_ranks_own_and_the_planners_line(runs, name):
    """The first and last pp ranks' planned model states differ (the embedding vs the final norm and head: the LM
    head, or the reward model's score), equal what each rank's ledger holds after step 1 (fp32 Adam, dp 1: exactly 16
    bytes a parameter; tp 2 splits the blocks' planned share; LoRA: 4 bytes a frozen base parameter, 16 an adapter's)
    and the planner's per-pp-rank lines (`python -m
    llmtrain.plan`), as do the activations and chunks in flight at that shape."""
    from llmtrain.compose import compose_config
    from llmtrain.plan.report import plan_text

    run = runs(name)
    first = read_metrics(run)[0][0]
    ranks = RUNS[name][0] if name in RUNS else PAIR_RUNS[name][0]
    states = [first[f"memory_r{rank}_plan_state"] for rank in range(ranks)]
    assert states[0] != states[-1] and first["plan_memory_state"] == states[0]
    for rank, state in enumerate(states):
        assert sum(first[f"memory_r{rank}_{key}"] for key in ("params", "grads", "optimizer")) == state, rank
    if name in PAIR_RUNS:
        return
    lines = plan_text(compose_config([*BASE, *RUNS[name][1], f"plan.world_size={ranks}"])).splitlines()
    for pp_rank, rank in enumerate((0, ranks - 1)):  # pp is the outer dimension: the first and last ranks
        [line] = [line for line in lines if line.startswith(f"pp rank {pp_rank}: ")]
        chunks, activations = first[f"memory_r{rank}_plan_in_flight"], first[f"memory_r{rank}_plan_activations"]
        assert f"model states {states[rank] / GIB:.3g} GiB" in line, line
        assert f"activations {chunks:.0f} micro-batch chunk(s) in flight ≈ {activations / GIB:.3g} GiB" in line, line
