"""A run that cannot fit stops before it loads (llmtrain/plan/fit.py `Budget`, `fit_problems`, `run_fit_problems`): the
decision on hand-made rows (a GPU: one device per rank; a CPU: the host's RAM over its local ranks, offload
included), the message's numbers and fixes, plan.enforce_fit=false, dry runs and the planner command that only
print, the tiny recipes that still pass, and the CLI on transformers' default Qwen3 config (~11B parameters: the
check stops it in seconds, no weights)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from llmtrain.backends import BACKENDS
from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.metrics.cost import GIB, Layout, StateBytes
from llmtrain.metrics.devices import GPUS, Gpu, host_memory_gib
from llmtrain.plan.core import USABLE, Row
from llmtrain.plan.fit import Budget, fit_budget, fit_problems, local_ranks, run_fit_problems
from llmtrain.plan.report import plan_run
from tests.helpers import REPO, cli_env

# transformers' Qwen3Config() as it ships: 32 layers, h=4096, i=22016, ~11B parameters (the tiny group's fields
# dropped with from_config=null); fp32 DDP on a CPU at sft_tiny's micro-batch 32, s=64: 193 GiB per rank
QWEN3 = ["recipe=sft_tiny", "model=tiny_llama", "model.from_config=null", "model.from_config.model_type=qwen3"]
HOST = ["device=cpu", "plan.memory_gb=23.5"]  # in-process checks: this 23.5 GiB host, whatever host runs them
CPU = Gpu("cpu", None, 0.0, 5)


def row(states_gib: float, activations_gib: float = 0.0, *, host_gib: float = 0.0) -> Row:
    """A hand-made DDP row: its model states (host_gib of them offloaded to host memory), activations at the
    micro-batch, no logits."""
    states = StateBytes(weights=states_gib * GIB, master=0.0, grads=0.0, optim=0.0, gathered=0.0, host=host_gib * GIB)
    device = states.device + activations_gib * GIB
    return Row(Layout(name="ddp", backend=BACKENDS["ddp"], stage=0, dp=1), {"policy": states}, activations_gib * GIB,
               0.0, device, fits=False, max_micro=0)


# ---- the decision ---------------------------------------------------------------------------------------------

def test_a_gpu_holds_one_rank_and_usable_is_its_memory_times_usable():
    budget = fit_budget(GPUS["h100-80gb"], ranks_on_host=8)  # the host's rank count does not matter on a GPU
    assert (budget.ranks, budget.per_rank) == (1, 79.6 * GIB * USABLE)
    limit = 79.6 * USABLE  # 73.2 GiB
    assert budget.fits(row(limit - 0.01)) and not budget.fits(row(limit + 0.01))
    assert fit_problems(row(limit - 0.01), budget, micro=4) == []
    assert budget.held(row(10, host_gib=8)) == 2 * GIB  # offloaded bytes are off the GPU


def test_a_cpu_host_shares_its_ram_between_its_local_ranks():
    """ranks × a rank's total ≤ RAM × USABLE: 4 ranks of 14 GiB fit 64 GiB of RAM (58.9 usable), 4 of 15 do not,
    3 of 15 do; a CPU's "host" offload is the same RAM and counts."""
    four, three = fit_budget(CPU, 4, host_gib=64.0), fit_budget(CPU, 3, host_gib=64.0)
    assert four == Budget("cpu", 64.0, ranks=4)
    assert four.per_rank == pytest.approx(64 * GIB * USABLE / 4)
    assert four.fits(row(14.0)) and not four.fits(row(15.0)) and three.fits(row(15.0))
    offloading = row(18.0, host_gib=8.0)  # 10 GiB on the "device", 8 in host memory: 4 × 18 > 58.9
    assert not four.fits(offloading) and four.held(offloading) == 18 * GIB
    assert fit_budget(GPUS["rtx-4090"]).held(offloading) == 10 * GIB
    message = "\n".join(fit_problems(row(15.0), four, micro=1))
    assert "host's RAM is shared by its 4 ranks (LOCAL_WORLD_SIZE): 4 × 15 = 60 GiB needed" in message
    assert f"58.9 GiB usable ({USABLE:.0%} of 64.0 GiB)" in message


def test_the_host_ram_and_the_local_ranks_come_from_the_machine(monkeypatch):
    assert fit_budget(CPU).memory_gib == pytest.approx(host_memory_gib()) and fit_budget(CPU).ranks == 1
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert local_ranks() == 1
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's name
    assert local_ranks() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's
    assert local_ranks() == 3


def test_the_message_gives_the_numbers_the_largest_micro_batch_and_the_override():
    """60 GiB of states + 5 GiB per sample at micro-batch 4 = 80 GiB on an H100 (73.2 usable): 2 samples fit."""
    budget = fit_budget(GPUS["h100-80gb"])
    lines = fit_problems(row(60.0, 20.0), budget, micro=4, fixes=["model.activation_checkpointing=true: 61 (fits)"],
                         subject="model m")
    message = "\n".join(lines)
    assert lines[0].startswith("the plan does not fit: model m, backend ddp needs 80 GiB per rank at "
                               "trainer.micro_batch_size=4 (model states 60, activations 20, logits 0)")
    assert "one h100-80gb per rank has 73.2 GiB usable (92% of 79.6 GiB); the largest micro-batch that fits is 2" \
        in message
    assert "  - model.activation_checkpointing=true: 61 (fits)" in lines
    assert lines[-1].startswith("stopped before loading anything; plan.enforce_fit=false runs it anyway")
    too_big = "\n".join(fit_problems(row(75.0, 1.0), budget, micro=1))
    assert "even micro-batch 1 does not fit (the model states alone need 75 GiB per rank)" in too_big
    assert "no override of this run lowers it" in too_big


# ---- the run's check: plan_run once, then run_fit_problems ----------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_plan():
    cfg = compose_config([*QWEN3, *HOST])
    return cfg, plan_run(cfg, 1, torch.device("cpu"), "fp32")


def test_the_default_qwen3_config_is_refused_with_the_fixes_that_apply(qwen3_plan, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg, plan = qwen3_plan
    message = "\n".join(run_fit_problems(cfg, plan))
    assert "the plan does not fit: model qwen3 (10.81B parameters), precision fp32, world 1, backend ddp" in message
    assert "needs 193 GiB per rank at trainer.micro_batch_size=32 (model states 161, activations 31.6" in message
    assert "1 × 193 = 193 GiB needed, 21.6 GiB usable (92% of 23.5 GiB)" in message
    assert "even micro-batch 1 does not fit (the model states alone need 161 GiB per rank)" in message
    assert "  - model.activation_checkpointing=true: 163 (still too much)" in message
    assert "  - peft=lora: 72.3 (still too much)" in message
    assert "model.activation_checkpointing=true peft=lora together: 42.8" in message
    assert "trainer.micro_batch_size=1:" not in message  # no micro-batch fits: not offered
    assert "backend=" not in message  # one CPU rank: sharding over dp 1 and offload to the same RAM lower nothing
    assert "plan.enforce_fit=false" in message


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_default_moe_configs_are_refused(model_type):
    """Qwen3-MoE's defaults: 227 GiB per rank here (the issue's "227 of 23.5 GiB"); Mixtral's 715."""
    cfg = compose_config([*QWEN3[:3], f"model.from_config.model_type={model_type}", *HOST])
    problems = run_fit_problems(cfg, plan_run(cfg, 1, torch.device("cpu"), "fp32"))
    assert problems[0].startswith(f"the plan does not fit: model {model_type} (")


def test_enforce_fit_false_lets_the_same_plan_run(qwen3_plan):
    cfg, plan = qwen3_plan
    assert run_fit_problems(cfg, plan)
    assert run_fit_problems(compose_config([*QWEN3, *HOST, "plan.enforce_fit=false"]), plan) == []


class ProcessGroupReached(Exception):
    """init_distributed stubbed: the run got past the fit check without loading anything."""


@pytest.fixture
def no_process_group(monkeypatch):
    import llmtrain.run

    def stop(*args, **kwargs):
        raise ProcessGroupReached

    monkeypatch.setattr(llmtrain.run, "init_distributed", stop)
    return llmtrain.run.run


def test_run_stops_before_the_process_group_unless_told_otherwise(no_process_group, tmp_path, capsys):
    run = no_process_group
    with pytest.raises(ConfigError, match="the plan does not fit"):
        run(compose_config([*QWEN3, *HOST, f"output_dir={tmp_path / 'a'}"]))
    with pytest.raises(ProcessGroupReached):
        run(compose_config([*QWEN3, *HOST, "plan.enforce_fit=false", f"output_dir={tmp_path / 'b'}"]))
    run(compose_config([*QWEN3, *HOST, "dry_run=true", f"output_dir={tmp_path / 'c'}"]))
    assert "ddp: does NOT fit" in capsys.readouterr().out  # a dry run only prints
    with pytest.raises(ProcessGroupReached):  # the tiny recipe passes the check
        run(compose_config(["recipe=sft_tiny", "device=cpu", f"output_dir={tmp_path / 'd'}"]))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args", [["recipe=sft_tiny"], ["recipe=pretrain_tiny"], ["recipe=sft_tiny", "peft=lora"],
                                  ["recipe=sft_tiny", "backend=zero3"]])
def test_the_tiny_recipes_fit(args):
    """The recipes that need no trained base (the others' bases are built on first use: minutes)."""
    cfg = compose_config([*args, "device=cpu"])
    assert run_fit_problems(cfg, plan_run(cfg, 1, torch.device("cpu"), "fp32")) == []


def test_the_planner_command_prints_a_plan_that_does_not_fit():
    from llmtrain.plan.report import plan_text

    assert "ddp: does NOT fit at micro-batch 32" in plan_text(compose_config([*QWEN3, *HOST]))


# ---- the command line ---------------------------------------------------------------------------------------

# a start-up and a plan: ~20 s alone, ~60 s with a 2-rank launch beside it (the suite's two workers); loading the
# model instead takes many minutes
STOPS_WITHIN_S = 180


def test_the_cli_stops_the_default_qwen3_config_in_seconds(tmp_path):
    """Before the check it ran on, loading ~11B parameters until the kernel killed it (exit 137, minutes)."""
    env = cli_env()
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    # this machine's device and memory (a CPU's RAM by os.sysconf); a host whose RAM could hold 193 GiB gets
    # s=4096 (~2 TB per rank), so no host goes on to load the model (and the timeout kills it if one did)
    big_host = ["data.max_seq_len=4096"] if host_memory_gib() * USABLE > 150 else []
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "llmtrain", *QWEN3, *big_host, f"output_dir={tmp_path / 'run'}"],
                            cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=STOPS_WITHIN_S)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr[-3000:]
    assert elapsed < STOPS_WITHIN_S
    assert "llmtrain: error on rank 0: the plan does not fit: model qwen3" in result.stderr
    assert "plan.enforce_fit=false runs it anyway" in result.stderr
    assert not (tmp_path / "run").exists()
