"""The planner's inference engine (ppo.rollout.engine=vllm, llmtrain/plan/rl.py): the engine's weights, KV cache and
budget per engine GPU against a hand computation, the setup read from ppo.rollout.vllm (args included), the peak of a
GPU the engine shares with a training rank (sleep or not) against one of its own, and the shipped grpo_8b recipe's
dry run (offline: the shipped Qwen3-8B config.json, no engine imported or contacted) printing the engine section."""

from __future__ import annotations

import math
import socket
import sys

import pytest

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.metrics.cost import GIB
from llmtrain.metrics.devices import GPUS, Gpu
from llmtrain.plan.rl import (
    EngineModel,
    EngineSetup,
    colocated_peak,
    colocated_utilization,
    engine_arg,
    engine_int,
    engine_memory,
    engine_model,
    engine_setup,
    engine_utilization_needed,
    vllm_batch_defaults,
)

SMALL = EngineModel(params=1_000_000, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                    vocab=100, max_positions=256)
DEVICE = Gpu("test", None, 1.0, 1.0)  # 1 GiB


def setup(**kw) -> EngineSetup:
    fields = dict(colocated=False, sleep=False, servers=2, tp=2, dp=1, utilization=0.5, weight_bytes=2, kv_bytes=2,
                  max_num_seqs=8, max_batched_tokens=64)
    return EngineSetup(**(fields | kw))


# ---- the figures by hand ------------------------------------------------------------------------------------------

def test_engine_figures_by_hand():
    """tp 2 over 2 servers, bf16, 10 sequences of 40 tokens: 5 per engine, 48 tokens each in 16-token blocks."""
    mem = engine_memory(SMALL, setup(), DEVICE, samples=10, seq=40)
    assert mem.weights == 1_000_000 * 2 / 2
    kv_per_token = 2 * 2 * 1 * 16 * 2  # K and V × layers × ⌈2 kv heads / tp 2⌉ × head_dim × bytes
    assert mem.kv_per_token == kv_per_token == 128
    assert (mem.tokens, mem.sequences) == (48, 5)
    assert mem.kv_needed == kv_per_token * 48 * 5 == 30_720
    assert mem.activations == 64 * (4 * 64 + (4 + 2 * 2) * 16 / 2 + 3 * 128 / 2) * 2 + 2 * 8 * 100 * 4 == 71_936
    assert mem.budget == 0.5 * GIB
    assert mem.kv_space == 0.5 * GIB - 1_000_000 - 71_936
    assert mem.fits and mem.at_once == (0.5 * GIB - 1_071_936) // (128 * 48)
    assert mem.max_model_len == 256 and mem.starts  # the model's max_position_embeddings
    assert engine_utilization_needed(mem, DEVICE) == (1_000_000 + 71_936 + 30_720) / GIB


def test_tp_beyond_the_kv_heads_repeats_them_and_fp8_halves_the_cache():
    tp4 = engine_memory(SMALL, setup(tp=4), DEVICE, samples=10, seq=40)
    assert tp4.kv_per_token == 2 * 2 * 1 * 16 * 2  # ⌈2/4⌉ = 1 head per GPU, not a half
    assert tp4.weights == 1_000_000 * 2 / 4
    fp8 = engine_memory(SMALL, setup(kv_bytes=1), DEVICE, samples=10, seq=40)
    assert fp8.kv_per_token == 64


def test_a_cache_too_small_runs_fewer_sequences_and_a_long_max_model_len_stops_vllm():
    """A budget of 1 MiB + activations + 3.5 sequences: 3 of the 5 at once; one of max_model_len 10,000 tokens does
    not fit the space."""
    tiny = engine_memory(SMALL, setup(), DEVICE, samples=10, seq=40)
    space = 3.5 * 128 * 48
    u = (tiny.weights + tiny.activations + space) / GIB
    mem = engine_memory(SMALL, setup(utilization=u, max_model_len=10_000), DEVICE, samples=10, seq=40)
    assert mem.kv_space == pytest.approx(space) and not mem.fits and mem.at_once == 3
    assert mem.max_model_len == 10_000 and not mem.starts


def test_vllm_defaults_follow_the_gpu():
    assert vllm_batch_defaults(GPUS["h200"]) == vllm_batch_defaults(GPUS["h100-80gb"]) == (8192, 1024)
    assert vllm_batch_defaults(GPUS["a100-80gb"]) == vllm_batch_defaults(GPUS["rtx-4090"]) == (2048, 256)
    h200 = engine_memory(SMALL, setup(max_num_seqs=None, max_batched_tokens=None), GPUS["h200"], samples=10, seq=40)
    assert (h200.batched_tokens, h200.max_num_seqs) == (8192, 1024)


# ---- the peak of a shared GPU -------------------------------------------------------------------------------------

def test_colocated_peak_with_and_without_sleep():
    """Training peak 50 (of it 30 model states), engine budget 40, on 100 (92 usable): awake throughout the sum, 90;
    asleep while the trainer updates max(50, 30 + 40) = 70; the largest utilization: (92 - 50)/100 and
    (92 - 30)/100; a training rank that alone does not fit leaves none."""
    assert colocated_peak(50, 30, 40, sleep=False) == 90
    assert colocated_peak(50, 30, 40, sleep=True) == 70
    assert colocated_peak(50, 30, 10, sleep=True) == 50  # the engine's budget under the training peak
    assert colocated_utilization(50, 30, 100, 0.92, sleep=False) == pytest.approx(0.42)
    assert colocated_utilization(50, 30, 100, 0.92, sleep=True) == pytest.approx(0.62)
    assert colocated_utilization(95, 30, 100, 0.92, sleep=True) == 0.0


# ---- the config ---------------------------------------------------------------------------------------------------

def test_engine_args_are_read_in_both_spellings():
    args = ["--tensor-parallel-size", "2", "--max-model-len=4096", "-dp", "4", "--enforce-eager"]
    assert engine_arg(args, "--tensor-parallel-size", "-tp") == "2"
    assert engine_arg(args, "--max-model-len") == "4096"
    assert engine_arg(args, "--data-parallel-size", "-dp") == "4"
    assert engine_arg(args, "--max-num-seqs") is None
    assert engine_arg(["-tp=8"], "--tensor-parallel-size", "-tp") == "8"
    assert [engine_int(v, "x") for v in ("4096", "32k", "40K", "1m")] == [4096, 32_000, 40_960, 1_000_000]
    with pytest.raises(ConfigError, match="ppo.rollout.vllm.args: --max-model-len auto: not a whole number"):
        engine_setup(compose_config([*GRPO_TINY_VLLM, "ppo.rollout.vllm.args=['--max-model-len',auto]"]), "bf16")


GRPO_TINY_VLLM = ["recipe=grpo_tiny", "model.name_or_path=null", "model=tiny_qwen2", "ppo.rollout.engine=vllm"]


def test_engine_setup_from_ppo_rollout_vllm():
    assert engine_setup(compose_config(["recipe=grpo_tiny"]), "bf16") is None  # engine=hf: the trainer samples
    servers = engine_setup(compose_config([*GRPO_TINY_VLLM, "ppo.rollout.vllm.urls=[http://a:8000,http://b:8000]",
                                           "ppo.rollout.vllm.args=['-tp','2','--data-parallel-size=2',"
                                           "'--kv-cache-dtype',fp8]"]), "bf16")
    assert (servers.mode, servers.tp, servers.dp, servers.replicas, servers.gpus) == ("server", 2, 2, 4, 8)
    assert (servers.weight_bytes, servers.kv_bytes, servers.utilization) == (2, 1, 0.9)
    colocated = engine_setup(compose_config([*GRPO_TINY_VLLM, "ppo.rollout.vllm.python=/env/bin/python",
                                             "ppo.rollout.vllm.sleep=true"]), "fp32")
    assert (colocated.mode, colocated.sleep, colocated.servers, colocated.tp, colocated.weight_bytes) == \
        ("colocated", True, 1, 1, 4)
    assert colocated.max_model_len == 64 and servers.max_model_len is None  # started with data.max_seq_len
    started = engine_setup(compose_config([*GRPO_TINY_VLLM, "ppo.rollout.vllm.python=/env/bin/python"]), "bf16")
    assert started.colocated and not started.sleep  # the server llmtrain starts runs on the training GPUs


# ---- the shipped recipe -------------------------------------------------------------------------------------------

def refuse_connections(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a dry run contacted {args[1:] or kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_grpo_8b_engine_figures_are_the_docs_example():
    """docs/formulas.md's example: Qwen3-8B (the shipped config.json), one server with tp 2 on H200s, 512 sequences
    of 2,048 tokens."""
    cfg = compose_config(["recipe=grpo_8b"])
    from llmtrain.models.facts import model_facts

    model = engine_model(cfg, model_facts(cfg))
    assert (model.params, model.layers, model.kv_heads, model.head_dim, model.vocab) == \
        (8_190_735_360, 36, 8, 128, 151_936)
    engine = engine_setup(cfg, "bf16")
    assert (engine.mode, engine.tp, engine.replicas, engine.utilization) == ("server", 2, 1, 0.9)
    mem = engine_memory(model, engine, GPUS["h200"], samples=512, seq=2048)
    assert round(mem.weights / GIB, 2) == 7.63 and mem.kv_per_token == 72 * 1024
    assert mem.kv_per_sequence == 144 * 2 ** 20 and mem.kv_needed == 72 * GIB
    assert round(mem.activations / GIB, 2) == 1.74 and round(mem.kv_space / GIB, 1) == 117.0
    assert mem.fits and mem.at_once == 831 and mem.starts
    assert math.ceil(engine_utilization_needed(mem, GPUS["h200"]) * 100) / 100 == 0.58


def test_grpo_8b_dry_run_prints_the_engine_section_offline(tmp_path, capsys, monkeypatch):
    """`python -m llmtrain recipe=grpo_8b dry_run=true` in one process: validated and planned for its 8 × H200
    (plan.world_size, plan.gpu), the engine per engine GPU; the placeholder server is never contacted and the engine
    code never imported."""
    from llmtrain.__main__ import main

    refuse_connections(monkeypatch)
    engine_code = ("llmtrain.stages.ppo.engines.vllm", "llmtrain.stages.ppo.engines.vllm_server",
                   "llmtrain.stages.ppo.engines.http")  # what talks to a server (the package's names are validation's)
    engines_loaded = {name: name in sys.modules for name in engine_code}
    assert main(["recipe=grpo_8b", "dry_run=true", f"output_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "world 8 (plan.world_size; this process: world 1)" in out and "plan: 8 × h200 (140.4 GiB" in out
    assert "engine: vLLM server, 1 server × dp 1 × tp 2 = 2 GPU(s) of its own, h200" in out
    assert "engine per GPU, GiB: weights M·w/t 7.63, activations 1.74" in out
    assert ("512 sequences in flight per engine (prompts × samples / 1 engine(s)) × 2,048 tokens (prompt + new, in "
            "16-token blocks) need 72 GiB: fits (831 such sequences fit at once)") in out
    assert "engine GPUs hold the engine alone" in out and "zero3: fits at micro-batch 16" in out
    assert {name: name in sys.modules for name in engine_code} == engines_loaded
    assert not (tmp_path / "run").exists()


def test_grpo_8b_colocated_prints_the_shared_peak(monkeypatch):
    """The same recipe with the engine asleep on the training GPUs: the per-GPU peak with the trainer's model states
    and the largest utilization that fits, by the planner's own row."""
    from llmtrain.plan.report import plan_text

    refuse_connections(monkeypatch)
    text = plan_text(compose_config(["recipe=grpo_8b", "ppo.rollout.vllm.sleep=true",
                                     "ppo.rollout.vllm.gpu_memory_utilization=0.5"]))
    [line] = [line for line in text.splitlines() if line.startswith("zero3 + engine")]
    assert "max(training peak, model states + engine budget) = 96.7 of 140.4 GiB (92% usable): fits" in line
    assert line.endswith("the largest gpu_memory_utilization that fits: 0.73")
    assert "engine: vLLM colocated, 1 server × dp 1 × tp 2 = 2 GPU(s) shared with training ranks (sleeps" in text
