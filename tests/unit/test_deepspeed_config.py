"""The DeepSpeed config builder, its pure checks, the presets and the model-state formulas (no deepspeed import)."""

from __future__ import annotations

import pytest
import torch

from llmtrain.backends.deepspeed_config import DeepSpeedSettings, OffloadSettings, build_ds_config, deep_merge
from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.metrics.memory import StorageLedger, deepspeed_expected, formula_16m
from llmtrain.validation import config_problems, validate

PRESETS = {"deepspeed": (2, "none", "none"), "zero0": (0, "none", "none"), "zero1": (1, "none", "none"),
           "zero2": (2, "none", "none"), "zero3": (3, "none", "none"), "zero3_offload": (3, "cpu", "cpu")}


def settings(**changes) -> DeepSpeedSettings:
    base = dict(zero_stage=2, micro_batch_size=4, grad_accum_steps=2)
    return DeepSpeedSettings(**{**base, **changes})


def test_batch_triple_clipping_and_precision_come_from_our_values():
    config = build_ds_config(settings(), dp_size=8, precision="bf16", max_grad_norm=0.0, hidden_size=64)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (4, 2, 64)
    assert config["gradient_clipping"] == 0.0  # written even when 0: DeepSpeed's default would clip at 1.0
    assert config["bf16"] == {"enabled": True} and config["fp16"]["enabled"] is False
    assert "optimizer" not in config and "scheduler" not in config  # ours go in as client objects


def test_zero_sections_follow_the_stage():
    z2 = build_ds_config(settings(offload_optimizer=OffloadSettings("cpu")), dp_size=2, precision="fp32",
                         max_grad_norm=1.0, hidden_size=64)["zero_optimization"]
    assert z2["stage"] == 2 and z2["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in z2 and "stage3_param_persistence_threshold" not in z2
    nvme = OffloadSettings("nvme", "/nvme", False)
    z3 = build_ds_config(settings(zero_stage=3, offload_param=nvme, stage3_param_persistence_threshold=7),
                         dp_size=2, precision="fp32", max_grad_norm=1.0, hidden_size=64)["zero_optimization"]
    assert z3["offload_param"] == {"device": "nvme", "nvme_path": "/nvme", "pin_memory": False}
    assert z3["stage3_param_persistence_threshold"] == 7 and "offload_optimizer" not in z3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_accumulate_and_reduce_in_fp32_where_deepspeed_allows(stage):
    """DeepSpeed 0.19.8 defaults to bf16 gradient accumulation and reduction under bf16 (DDP/FSDP2: fp32).
    ZeRO-0 refuses fp32 accumulation with bf16 weights; ZeRO-1 then runs BF16_Optimizer (immediate update).
    The dtypes DeepSpeed really uses are checked in tests/dist/test_deepspeed_bf16.py."""
    config = build_ds_config(settings(zero_stage=stage), dp_size=2, precision="bf16", max_grad_norm=1.0,
                             hidden_size=64)
    assert config["communication_data_type"] == "fp32"
    assert config.get("data_types") == (None if stage == 0 else {"grad_accum_dtype": "fp32"})
    assert config["bf16"] == ({"enabled": True, "immediate_grad_update": True} if stage == 1 else {"enabled": True})
    for precision in ("fp32", "fp16"):  # only bf16 changes DeepSpeed's defaults
        other = build_ds_config(settings(zero_stage=stage), dp_size=2, precision=precision, max_grad_norm=1.0,
                                hidden_size=64)
        assert "communication_data_type" not in other and "data_types" not in other
    back = {"communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "bf16"}}  # a user's choice wins
    config = build_ds_config(settings(zero_stage=stage, overrides=back), dp_size=2, precision="bf16",
                             max_grad_norm=1.0, hidden_size=64)
    assert config["communication_data_type"] == "bf16" and config["data_types"] == {"grad_accum_dtype": "bf16"}


def test_overrides_are_deep_merged_last():
    overrides = {"zero_optimization": {"round_robin_gradients": True, "reduce_bucket_size": 5}, "comms_logger": {}}
    config = build_ds_config(settings(overrides=overrides), dp_size=2, precision="fp32", max_grad_norm=1.0,
                             hidden_size=64)
    zero = config["zero_optimization"]
    assert zero["round_robin_gradients"] is True and zero["reduce_bucket_size"] == 5 and zero["stage"] == 2
    assert config["comms_logger"] == {}
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}


def zero_section(hidden_size: int | None, **changes) -> dict:
    return build_ds_config(settings(**changes), dp_size=2, precision="fp32", max_grad_norm=1.0,
                           hidden_size=hidden_size)["zero_optimization"]


def test_auto_sizes_follow_the_hidden_size():
    h = 128
    z3 = zero_section(h, zero_stage=3)
    assert (z3["reduce_bucket_size"], z3["stage3_prefetch_bucket_size"], z3["stage3_param_persistence_threshold"]) \
        == (16384, 14745, 1280)  # h², int(0.9·h²), 10·h
    z2 = zero_section(h, zero_stage=2)
    assert z2["reduce_bucket_size"] == 16384 and "stage3_prefetch_bucket_size" not in z2
    # before the model exists (zero.Init) "auto" sizes are left to DeepSpeed, explicit ones written
    z3_init = zero_section(None, zero_stage=3, stage3_prefetch_bucket_size=7)
    assert "reduce_bucket_size" not in z3_init and "stage3_param_persistence_threshold" not in z3_init
    assert z3_init["stage3_prefetch_bucket_size"] == 7


def test_explicit_sizes_and_overrides_win_over_auto():
    z3 = zero_section(128, zero_stage=3, reduce_bucket_size=1000, stage3_param_persistence_threshold=0)
    assert (z3["reduce_bucket_size"], z3["stage3_prefetch_bucket_size"], z3["stage3_param_persistence_threshold"]) \
        == (1000, 14745, 0)
    overrides = {"zero_optimization": {"reduce_bucket_size": 5, "use_multi_rank_bucket_allreduce": True}}
    z2 = zero_section(128, zero_stage=2, overrides=overrides)
    assert z2["reduce_bucket_size"] == 5 and z2["use_multi_rank_bucket_allreduce"] is True


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_1_2_reduce_each_partition_to_its_owner(stage):
    """DeepSpeed's default all-reduces ZeRO-1/2 gradient buckets (twice the traffic); other stages lack the key."""
    zero = zero_section(64, zero_stage=stage)
    assert zero.get("use_multi_rank_bucket_allreduce") is (False if stage in (1, 2) else None)


def test_hidden_size_is_read_from_the_model_config():
    from types import SimpleNamespace

    from transformers import GPT2Config

    from llmtrain.backends.deepspeed import model_hidden_size

    assert model_hidden_size(SimpleNamespace(config=GPT2Config(n_embd=96))) == 96  # via its attribute map
    assert model_hidden_size(SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(hidden_size=32)))) == 32
    assert model_hidden_size(torch.nn.Linear(2, 2)) is None


def test_settings_from_backend_options_need_the_batch():
    options = {"zero_stage": 3, "offload_param": {"device": "cpu", "nvme_path": None, "pin_memory": False},
               "run": {"micro_batch_size": 2, "grad_accum_steps": 3, "output_dir": "/tmp/x"}}
    s = DeepSpeedSettings.from_options(options)
    assert (s.zero_stage, s.micro_batch_size, s.grad_accum_steps, s.offload_param.device) == (3, 2, 3, "cpu")
    with pytest.raises(ValueError, match="micro_batch_size"):
        DeepSpeedSettings.from_options({"zero_stage": 1})


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_are_one_backend(preset):
    cfg = compose_config(["recipe=sft_tiny", f"backend={preset}"])
    b = cfg.backend
    assert (b.name, b.zero_stage, b.offload_optimizer.device, b.offload_param.device) == ("deepspeed", *PRESETS[preset])
    assert config_problems(cfg, 2) == []
    assert compose_config(["recipe=sft_tiny", f"backend={preset}", "backend.zero_stage=1",
                           "backend.offload_param.device=none"]).backend.zero_stage == 1


BAD = {
    "backend.zero_stage=4": "backend.zero_stage=4 must be 0, 1, 2 or 3",
    "backend.offload_param.device=cpu": "backend.offload_param.device=cpu needs backend.zero_stage=3",
    "backend.offload_optimizer.device=nvme":
        "backend.offload_optimizer.device=nvme needs backend.offload_optimizer.nvme_path",
    "backend.offload_optimizer.device=disk": "backend.offload_optimizer.device='disk' must be one of none, cpu, nvme",
    "backend.reduce_bucket_size=0":
        "backend.reduce_bucket_size=0 must be \"auto\" (sized from the model's hidden size) or an integer >= 1",
    "backend.stage3_param_persistence_threshold=big": "backend.stage3_param_persistence_threshold='big' must be "
                                                      "\"auto\"",
    "backend.stage3_prefetch_bucket_size=5e7": "backend.stage3_prefetch_bucket_size=50000000.0 must be",
    "backend.allgather_bucket_size=-1": "backend.allgather_bucket_size=-1 must be an integer >= 1",
    "backend.ds_config_overrides={gradient_accumulation_steps: 4}":
        "backend.ds_config_overrides.gradient_accumulation_steps is set by llmtrain from trainer.grad_accum_steps",
    "backend.ds_config_overrides={zero_optimization: {stage: 3}}":
        "backend.ds_config_overrides.zero_optimization.stage is set by llmtrain from backend.zero_stage",
    "backend.ds_config_overrides={optimizer: {type: Adam}}": "backend.ds_config_overrides.optimizer is set by llmtrain",
    "backend.ds_config_overrides=5": "backend.ds_config_overrides=5 must be a mapping",
}


@pytest.mark.parametrize("override", sorted(BAD))
def test_each_bad_field_is_named(override):
    cfg = compose_config(["recipe=sft_tiny", "backend=zero2", override])
    problems = config_problems(cfg, 2)
    assert len(problems) == 1 and BAD[override] in problems[0], problems


def test_optimizer_offload_needs_a_zero_stage():
    cfg = compose_config(["recipe=sft_tiny", "backend=zero0", "backend.offload_optimizer.device=cpu"])
    with pytest.raises(ConfigError, match=r"offload_optimizer.device=cpu needs backend.zero_stage >= 1"):
        validate(cfg, 2)


def test_expected_bytes_follow_docs_formulas_md():
    m, n = 1000, 4
    for stage in range(4):
        plain = deepspeed_expected(num_params=m, persistent_params=0, stage=stage, dp=n, grad_accum_steps=2,
                                   offload_optimizer=False, offload_param=False)
        unadjusted = plain["params"] + plain["grads"] + plain["optim"]  # without DeepSpeed's master copy
        assert unadjusted == pytest.approx(formula_16m(num_params=m, stage=stage, dp=n))
        assert plain["master"] == (0 if stage == 0 else 4 * m / n)
    assert formula_16m(num_params=m, stage=0, dp=n) == 16 * m and formula_16m(num_params=m, stage=3, dp=n) == 4 * m
    z3 = deepspeed_expected(num_params=m, persistent_params=100, stage=3, dp=n, grad_accum_steps=1,
                            offload_optimizer=True, offload_param=True)
    assert z3["params"] == 4 * (m / n + 100) and z3["host"] == 4 * m / n * 5
    z1 = deepspeed_expected(num_params=m, persistent_params=0, stage=1, dp=n, grad_accum_steps=1,
                            offload_optimizer=False, offload_param=False)
    assert z1["grads"] == 4 * m / n  # no accumulation: whole gradients live only inside backward


def test_storage_ledger_counts_each_storage_once():
    flat = torch.zeros(100)
    ledger = StorageLedger()
    ledger.add("params", "views", [flat[:50], flat[50:]])
    ledger.add("grads", "same storage again", {"x": [flat]})
    ledger.add("master", "meta", [torch.empty(10, device="meta")])
    assert ledger.bytes["params"] == 400 and ledger.bytes["grads"] == 0 and ledger.bytes["master"] == 0


def test_a_stale_op_build_lock_is_named_and_a_fresh_one_is_not(tmp_path):
    """A DeepSpeed op build killed half-way leaves `<op>/lock` and every later run waits on it forever: the
    backend names such a lock (older than any build takes) before it loads an op; a build in progress is left be."""
    import os
    import time

    from llmtrain.backends.deepspeed_ops import STALE_AFTER_S, stale_build_locks

    killed = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    building = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (killed, building):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_AFTER_S - 60
    os.utime(killed, (old, old))
    assert stale_build_locks(tmp_path) == [killed]
