"""Fixtures shared by the torchrun tests of tests/dist: the SFT arguments several backends' runs start from, the
per-step comparison of two runs' metrics, the preference (RM/DPO) pair-run arguments, and the checks of the live
cost a 2-rank run logs on its first steps (llmtrain/metrics/live.py, comm.py) against the planner's figures in the
same records. Each fixture hands out a plain function; the workers that torchrun starts are in tests/dist/workers/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO, read_metrics

# ---- SFT runs: the arguments the runs of test_ddp.py, test_deepspeed.py and test_lora.py start from --------------

def _base_args(model_dir, out_dir, *extra):
    return ["recipe=sft_tiny", f"model.name_or_path={model_dir}", "model.from_config=null", "model.tokenizer=null",
            f"output_dir={out_dir}", "trainer.eval_every_n_steps=0", "data.eval_files=[]",
            "trainer.log_every_n_steps=0", "optim.lr=1e-3", "optim.warmup_steps=2", *extra]
# later overrides of the same key win (Hydra applies them in order)


@pytest.fixture(scope="session")
def base_args():
    """`base_args(model_dir, out_dir, *extra)`: a tiny SFT run's arguments from a saved model folder, no eval."""
    return _base_args


# ---- the per-step comparison of two runs -------------------------------------------------------------------------

def _assert_close_series(ours, reference, key, first_rel, rel, atol=0.0):
    """Per step |a − b| ≤ tol·|b| + atol (tol: first_rel on the first step, rel after); `atol` for values that are
    small differences of near-cancelling sums (PPO's KL)."""
    assert len(ours) == len(reference)
    for i, (a, b) in enumerate(zip(ours, reference)):
        tolerance = first_rel if i == 0 else rel
        assert abs(a[key] - b[key]) <= tolerance * abs(b[key]) + atol, f"step {i + 1} {key}: {a[key]} vs {b[key]}"


@pytest.fixture(scope="session")
def assert_close_series():
    """`assert_close_series(ours, reference, key, first_rel, rel, atol=0.0)` on two runs' metric records."""
    return _assert_close_series


# ---- preference pair runs (tests/dist/test_preference.py, test_lora.py) -------------------------------------------

DATA = REPO / "llmtrain" / "assets" / "data"
PAIRS = ["trainer.max_steps=6", "trainer.grad_accum_steps=2", "trainer.micro_batch_size=2",
         "trainer.save_every_n_steps=3", "trainer.keep_last_k=3", "trainer.eval_every_n_steps=3",
         "trainer.eval_batch_size=16", "trainer.log_every_n_steps=0", "optim.lr=1e-3", "optim.warmup_steps=2",
         "optim.weight_decay=0.1", "model.from_config=null", "model.tokenizer=null"]
PAIR_STAGES = {"rm": ["recipe=rm_tiny", f"data.eval_files=[{DATA / 'reverse_prefs_eval.jsonl'}]"],
               "dpo": ["recipe=dpo_tiny", f"data.eval_files=[{DATA / 'reverse_prefs_easy_eval.jsonl'}]",
                       "dpo.beta=0.5"],
               "simpo": ["recipe=simpo_tiny", f"data.eval_files=[{DATA / 'reverse_prefs_easy_eval.jsonl'}]"],
               "orpo": ["recipe=orpo_tiny", f"data.eval_files=[{DATA / 'reverse_prefs_easy_eval.jsonl'}]"],
               # 2 ranks × micro 2 completions × accumulation 2: 8 completions a step (4 pairs' worth, unpaired)
               "kto": ["recipe=kto_tiny", f"data.eval_files=[{DATA / 'reverse_prefs_easy_eval.jsonl'}]"]}


@pytest.fixture(scope="session")
def pair_args():
    """`pair_args(stage)`: a pair run's arguments for stage "rm", "dpo", "simpo", "orpo" or "kto" (6 steps of 8 pairs:
    micro 2 pairs × accumulation 2 × 2 ranks, fp32, saved at step 3, eval at 0, 3, 6), before the model, backend
    and output folder."""
    return lambda stage: [*PAIR_STAGES[stage], *PAIRS]


# ---- the live cost of a 2-rank run next to the plan --------------------------------------------------------------

def _model_states(record: dict, rank: int) -> float:
    """The ledger's per-rank model states after the first step: DeepSpeed's has a total, the others name the parts."""
    total = record.get(f"memory_r{rank}_total_bytes")
    return total if total is not None else sum(record[f"memory_r{rank}_{k}"] for k in ("params", "grads", "optimizer"))


def _counted(record: dict, who: str, key: str, routed: tuple[str, ...]) -> float:
    """`who`'s ("comm_r0" or "plan_comm") bytes of `key` (payload or wire), the routed kinds left out."""
    return record[f"{who}_{key}"] - sum(record.get(f"{who}_{kind}_{key}", 0.0) for kind in routed)


def _live_errors(run_dir: Path, ranks: int = 2, routed: tuple[str, ...] = ()) -> dict[str, float]:
    """Relative error (measured / planned - 1) of the model states (step 1), step 2's activations and counted
    communication, worst rank. Step 2: the first step may run one-time collectives (DeepSpeed's first ZeRO-3 trace).
    `routed` kinds (all_to_all under ep: what a rank receives follows the router) are left out: the caller checks
    them."""
    first, second = read_metrics(run_dir)[0][:2]
    assert second["step"] == 2
    errors = {"states": max((_model_states(first, r) / first["plan_memory_state"] - 1 for r in range(ranks)), key=abs)}
    for key in ("activations", "payload", "wire"):  # activations: each rank's plan is at its own batch shape
        pairs = [(second[f"memory_r{r}_activations"], second[f"memory_r{r}_plan_activations"]) if key == "activations"
                 else (_counted(second, f"comm_r{r}", key, routed), _counted(second, "plan_comm", key, routed))
                 for r in range(ranks)]
        assert all(m > 0 and p > 0 for m, p in pairs), (key, pairs)
        errors[key] = max((m / p - 1 for m, p in pairs), key=abs)
    for key in second:  # every kind the plan has was counted, within 5 % per kind on every rank
        if key.startswith("plan_comm_") and key.count("_") > 3 and not key.startswith(
                tuple(f"plan_comm_{kind}" for kind in routed)):
            kind_key = key[len("plan_comm_"):]
            for rank in range(ranks):
                measured = second[f"comm_r{rank}_{kind_key}"]
                assert abs(measured - second[key]) <= 0.05 * second[key], \
                    f"rank {rank} {kind_key}: {measured} vs {second[key]}"
    third = read_metrics(run_dir)[0][2]
    assert not any(k.startswith(("comm_", "plan_comm", "plan_memory")) for k in third)  # counting is off after 2
    return errors


def _assert_live_cost_matches_the_plan(run_dir: Path, ranks: int = 2, states: bool = True,
                                       routed: tuple[str, ...] = (), activations: bool = True) -> dict[str, float]:
    """`states=False` where the ledger (read after the optimizer step) and the plan (the peak between micro-batches)
    hold different things: FSDP2 with accumulation keeps whole gradients between micro-batches, sharded after.
    `activations=False` where a rank's share follows the router (ep: the rows its experts receive)."""
    errors = _live_errors(run_dir, ranks, routed)
    assert not states or abs(errors["states"]) <= 0.05, errors
    assert not activations or abs(errors["activations"]) <= 0.25, errors
    assert abs(errors["payload"]) <= 0.05 and abs(errors["wire"]) <= 0.05, errors
    print(f"{run_dir.name}: " + ", ".join(f"{k} {v:+.2%}" for k, v in errors.items()))
    return errors


@pytest.fixture(scope="session")
def assert_live_cost_matches_the_plan():
    """`assert_live_cost_matches_the_plan(run_dir, ranks=2, states=True) -> errors`: the live cost of a run the
    backend tests make anyway, against the plan in the same records."""
    return _assert_live_cost_matches_the_plan


# ---- the model families (tests/dist/test_families.py) ------------------------------------------------------------

TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512}
# model_type -> the from_config fields beyond TINY_SIZES that make the family's shape (vocab: the tokenizer's 263)
FAMILIES = {
    "llama": {"tie_word_embeddings": False,  # Llama-3: untied, llama3 rope scaling
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen2": {"tie_word_embeddings": True},  # q/k/v biases are the family's own
    "qwen3": {"head_dim": 16},  # q/k norms are the family's own
    "mistral": {"sliding_window": 16},  # shorter than most packed samples: the window is exercised
    "gemma2": {"head_dim": 16},  # no sdpa in transformers: eager; logit softcapping (attention, final)
    "gemma3_text": {"head_dim": 16, "sliding_window": 16},  # both layers sliding (every 6th is global)
    "phi3": {},  # its default pad_token_id 32000 lies outside the vocabulary: set from the tokenizer
    "gpt2": None,  # its own field names
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    # a shared expert beside the routed ones (trained by tests/dist/test_families.py's expert-parallel launch only)
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 96},
}
GPT2_SIZES = {"n_embd": 64, "n_inner": 128, "n_layer": 2, "n_head": 4, "n_positions": 512}
MOE_FAMILIES = ("mixtral", "qwen3_moe")
EP_FAMILIES = (*MOE_FAMILIES, "qwen2_moe")  # backend.ep (parallel/ep.py)
PARITY_FAMILIES = ("gemma2", "qwen3", *MOE_FAMILIES)  # eager attention, qk-norm, the router aux loss
# every family with a TP plan whose styles go beyond Llama's colwise/rowwise (qk-norm: qwen3, gemma3_text, qwen3_moe;
# gathered fused projections: phi3; experts: the MoE two) or whose attention differs (gemma2 eager, mistral window)
TP_FAMILIES = ("qwen3", "gemma3_text", "phi3", "gemma2", "mistral", *MOE_FAMILIES)


def pytest_generate_tests(metafunc):
    """A test that takes `family` runs once per FAMILIES entry, one that takes `parity_family` once per
    PARITY_FAMILIES entry, one that takes `tp_family` once per TP_FAMILIES entry (tests import no conftest: the
    lists live here, once)."""
    if "family" in metafunc.fixturenames:
        metafunc.parametrize("family", [f for f in FAMILIES if f not in EP_FAMILIES or f in MOE_FAMILIES])
    if "expert_family" in metafunc.fixturenames:
        metafunc.parametrize("expert_family", EP_FAMILIES)
    if "parity_family" in metafunc.fixturenames:
        metafunc.parametrize("parity_family", PARITY_FAMILIES)
    if "tp_family" in metafunc.fixturenames:
        metafunc.parametrize("tp_family", TP_FAMILIES)


@pytest.fixture(scope="session")
def families():
    """{"all": the FAMILIES every stage trains, "moe": MOE_FAMILIES, "parity": PARITY_FAMILIES, "tp": TP_FAMILIES,
    "ep": EP_FAMILIES}."""
    return {"all": [f for f in FAMILIES if f not in EP_FAMILIES or f in MOE_FAMILIES], "moe": MOE_FAMILIES,
            "parity": PARITY_FAMILIES, "tp": TP_FAMILIES, "ep": EP_FAMILIES}


def _literal(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_literal(v)}" for k, v in value.items()) + "}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _family_args(family: str) -> list[str]:
    from tests.helpers import TOKENIZER_DIR

    fields = {"model_type": family, **(GPT2_SIZES if FAMILIES[family] is None else {**TINY_SIZES, **FAMILIES[family]})}
    return ["model.name_or_path=null", f"model.from_config={_literal(fields)}", f"model.tokenizer={TOKENIZER_DIR}"]


@pytest.fixture(scope="session")
def family_args():
    """`family_args(model_type)`: the overrides that build a tiny random model of that family (FAMILIES) with the
    shipped tokenizer, after any recipe (the dpo/grpo recipes' ${base:sft_tiny} is replaced)."""
    return _family_args
