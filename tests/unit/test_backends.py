"""The backend registry: one descriptor per backend (typed config group, checks, layout, planner figures), the
project's message for another backend's key, and no backend named outside llmtrain/backends/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llmtrain.backends import (
    BACKENDS,
    backend_spec,
    backends_that,
    compared_presets,
    data_parallel_size,
    misplaced_key_message,
    spec_of,
)
from llmtrain.compose import compose_config, conf_dir
from llmtrain.config import ConfigError
from llmtrain.parallel import ParallelDims
from llmtrain.plan.core import layout_of, row_name
from llmtrain.validation import validate

PACKAGE = Path(__file__).resolve().parents[2] / "llmtrain"
# A backend's word used for something else: the deepspeed *package* whose version a run records.
OTHER_MEANINGS = {("run_metadata.py", "deepspeed")}


def test_every_preset_yaml_is_one_backends_typed_group():
    presets = {p: spec for spec in BACKENDS.values() for p in spec.presets}
    assert sorted(presets) == sorted(p.stem for p in (conf_dir() / "backend").glob("*.yaml"))
    for preset, spec in presets.items():
        backend = compose_config(["recipe=sft_tiny", f"backend={preset}"]).backend
        assert (backend.name, OmegaConf.get_type(backend)) == (spec.name, spec.config_class), preset
        assert tuple(backend) == spec.fields()  # its own fields only, no flat union


def test_the_planner_rows_come_from_the_descriptors():
    assert compared_presets() == ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2", "fsdp2_tp")
    for preset in compared_presets():
        backend = compose_config(["recipe=sft_tiny", f"backend={preset}"]).backend
        assert row_name(backend) == preset
    zero3_offload = layout_of("zero3_offload", compose_config(["recipe=sft_tiny", "backend=zero3_offload"]).backend,
                              8, 4096)
    assert (zero3_offload.stage, zero3_offload.dp, zero3_offload.offload_optimizer, zero3_offload.offload_param,
            zero3_offload.persistence_threshold) == (3, 8, "cpu", "cpu", 40960)
    tp = layout_of("fsdp2_tp", compose_config(["recipe=sft_tiny", "backend=fsdp2_tp"]).backend, 8, 64)
    assert (tp.backend, tp.stage, tp.dp, tp.tp) == (BACKENDS["fsdp2"], 3, 4, 2)


def test_capabilities_and_layouts():
    assert backends_that("loads_4bit_base") == ("ddp",)
    assert [name for name, s in BACKENDS.items() if s.frozen_in_compute_dtype] == ["deepspeed"]
    for preset, dp in (("ddp", 8), ("zero2", 8), ("fsdp2", 8), ("fsdp2_tp", 4)):
        assert data_parallel_size(compose_config(["recipe=sft_tiny", f"backend={preset}"]).backend, 8) == dp
    dims = backend_spec("deepspeed").parallel_dims(compose_config(["recipe=sft_tiny", "backend=zero3"]).backend, 4)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (1, 4, 1)
    with pytest.raises(ValueError, match="not one of ddp, deepspeed, fsdp2"):
        backend_spec("megatron")


@pytest.mark.parametrize("overrides,needle", [
    (["backend.zero_stage=2"], "config: backend.zero_stage is a field of the deepspeed backend "
                               "(backend=deepspeed/zero0/zero1/zero2/zero3/zero3_offload); backend ddp has: name"),
    (["backend.offload_param.device=cpu"], "backend.offload_param is a field of the deepspeed backend"),
    (["backend=zero2", "backend.tp=2"], "backend.tp is a field of the fsdp2 backend (backend=fsdp2/fsdp2_tp); "
                                        "backend deepspeed has: name, zero_stage,"),
    (["backend.pp=2"], "config: backend.pp is a field of the fsdp2 backend (backend=fsdp2/fsdp2_tp); "
                       "backend ddp has: name"),
    (["backend=zero3", "backend.pp=2"], "backend.pp is a field of the fsdp2 backend (backend=fsdp2/fsdp2_tp); "
                                        "backend deepspeed has: name, zero_stage,"),
    (["backend.sp=2"], "config: backend.sp is a field of the deepspeed backend (backend=deepspeed/zero0/zero1/zero2/"
                       "zero3/zero3_offload) and the fsdp2 backend (backend=fsdp2/fsdp2_tp); backend ddp has: name"),
    (["backend.cp=2"], "config: backend.cp is a field of the deepspeed backend (backend=deepspeed/zero0/zero1/zero2/"
                       "zero3/zero3_offload) and the fsdp2 backend (backend=fsdp2/fsdp2_tp) (DDP keeps whole rows on "
                       "every rank); backend ddp has: name"),
    (["backend=zero3", "backend.ep=2"], "config: backend.ep is a field of the fsdp2 backend (backend=fsdp2/fsdp2_tp) "
                                        "(DeepSpeed's MoE layer is not transformers' experts module"),
    (["backend=fsdp2", "backend.bogus=1"], "backend.bogus is not a field of any backend (ddp, deepspeed, fsdp2); "
                                           "backend fsdp2 has: name, dp_replicate, dp_shard, sp, cp, "
                                           "cp_implementation, ep, tp,"),
])
def test_a_key_of_another_backend_is_named_with_its_backend(overrides, needle):
    with pytest.raises(ConfigError) as error:
        compose_config(["recipe=sft_tiny", *overrides])
    assert needle in str(error.value) and "not in struct" not in str(error.value)


@pytest.mark.parametrize("overrides,needle", [
    (["+backend.zero_stage=2"], "backend.zero_stage is a field of the deepspeed backend"),
    (["backend.name=fsdp2"], "backend.name=fsdp2 does not change the backend group (ddp's fields): choose the "
                             "backend with backend=fsdp2"),
])
def test_what_composes_but_is_not_the_chosen_backend_fails_validation(overrides, needle):
    cfg = compose_config(["recipe=sft_tiny", *overrides])
    with pytest.raises(ConfigError, match="invalid config") as error:
        validate(cfg, world_size=1)
    assert needle in str(error.value)


def test_other_errors_keep_their_message():
    assert misplaced_key_message(ValueError("x")) is None
    with pytest.raises(ConfigError, match="backend.zero_stage=abc: Value 'abc'"):
        compose_config(["recipe=sft_tiny", "backend=zero3", "backend.zero_stage=abc"])


def test_spec_of_a_plain_node_is_the_one_it_names():
    assert spec_of(OmegaConf.create({"name": "fsdp2", "tp": 2})) is BACKENDS["fsdp2"]
    assert spec_of(BACKENDS["deepspeed"].config_from_options({"zero_stage": 3, "run": {}})) is BACKENDS["deepspeed"]
    assert spec_of(OmegaConf.create({"name": "megatron"})) is None


def test_parallel_dims_hands_out_meshes_by_name_only_with_a_device():
    flat = ParallelDims.build(4)
    assert flat.data_parallel(rank=3) == (3, 4, None)  # every rank its own data: the world, no mesh built
    assert flat.degrees == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "ep": 1, "pp": 1, "sp": 1, "tp": 1}
    with pytest.raises(ValueError, match="no device type"):
        ParallelDims.build(4, tp=2).mesh("tp")
    assert ParallelDims.build(4, tp=2).on("cpu") == ParallelDims.build(4, "cpu", tp=2)


def string_constants(path: Path) -> set[str]:
    """The string literals of a module's code (docstrings too: a name in prose is not a dispatch)."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_no_module_outside_backends_names_a_backend():
    """Backend and preset names live in backends/ (their descriptors) and the conf/backend yamls: the rest of
    llmtrain/ asks the registry."""
    names = set(BACKENDS) | {preset for spec in BACKENDS.values() for preset in spec.presets}
    named = [(str(path.relative_to(PACKAGE)), name) for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] != "backends"
             for name in sorted(names & string_constants(path))]
    assert [pair for pair in named if pair not in OTHER_MEANINGS] == []
