"""The DeepSpeed config, built from llmtrain's config: one source of truth, no hand-kept JSON.

Pure Python (no deepspeed import): `deepspeed_problems` runs on every rank before anything loads,
`build_ds_config` turns plain values into the dict handed to `deepspeed.initialize` (and written to
`${output_dir}/deepspeed_config.json`). `backend.ds_config_overrides` is deep-merged last, for any
DeepSpeed key we do not model; the keys llmtrain owns (batch, clipping, stage, precision, optimizer,
scheduler) cannot be overridden there, because the training loop would silently disagree with them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from llmtrain.config import BackendNode


@dataclass
class OffloadConfig:
    device: str = "none"  # none | cpu | nvme
    nvme_path: Optional[str] = None
    pin_memory: bool = True


@dataclass
class DeepSpeedConfig(BackendNode):
    """`backend=deepspeed` (and its presets zero0..zero3, zero3_offload): the DeepSpeed backend's typed group."""
    name: str = "deepspeed"
    zero_stage: int = 0
    sp: int = 1  # Ulysses sequence parallelism (models/ulysses.py); ZeRO partitions over every rank (dp × cp × sp)
    cp: int = 1  # context parallelism: ring attention (models/ring_attention.py)
    cp_implementation: str = "auto"  # ring | torch (torch's context_parallel, CUDA) | auto (parallel/cp.py)
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    # Sizes in elements, "auto" or an int. "auto" follows the model's hidden size h, as transformers'
    # DeepSpeed integration does: reduce bucket h², ZeRO-3 prefetch 0.9·h², persistence threshold 10·h
    # (ZeRO-3 keeps weights up to that size whole on every rank). Typed Any: OmegaConf has no int | str.
    reduce_bucket_size: Any = "auto"
    # Only chunks all-gathers when torch lacks all_gather_into_tensor: DeepSpeed 0.19 ignores it otherwise.
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: Any = "auto"
    stage3_param_persistence_threshold: Any = "auto"
    stage3_max_live_parameters: int = 1_000_000_000
    # {DeepSpeed key: value} for keys we do not model, deep-merged last. Typed Any, default null: then
    # `backend.ds_config_overrides={...}` assigns the dict (a Dict field would refuse every new key in
    # struct mode); the deepspeed check rejects anything but a mapping.
    ds_config_overrides: Any = None


_SCHEMA = DeepSpeedConfig()

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
AUTO = "auto"
# Sizes that may be "auto": resolved from the model's hidden size (`model_sized`).
AUTO_SIZED = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")

# DeepSpeed keys whose value comes from another llmtrain field (dotted path -> the field to set instead).
OWNED_KEYS = {
    "train_batch_size": "trainer.micro_batch_size / trainer.grad_accum_steps (global = micro × accum × dp)",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_size",
    "gradient_accumulation_steps": "trainer.grad_accum_steps",
    "gradient_clipping": "optim.max_grad_norm (0 = no clipping)",
    "zero_optimization.stage": "backend.zero_stage",
    "optimizer": "optim.* (llmtrain passes its own AdamW and schedule)",
    "scheduler": "optim.* (llmtrain passes its own AdamW and schedule)",
    "bf16.enabled": "precision=bf16",
    "fp16.enabled": "precision=fp16",
}


@dataclass(frozen=True)
class OffloadSettings:
    device: str = "none"  # none | cpu | nvme
    nvme_path: str | None = None
    pin_memory: bool = True


@dataclass(frozen=True)
class DeepSpeedSettings:
    """Everything the DeepSpeed backend needs, as plain values (see `from_options`)."""
    zero_stage: int
    micro_batch_size: int
    grad_accum_steps: int
    offload_optimizer: OffloadSettings = OffloadSettings()
    offload_param: OffloadSettings = OffloadSettings()
    # defaults come from the config schema: one source of truth for `backend.*`
    overlap_comm: bool = _SCHEMA.overlap_comm
    contiguous_gradients: bool = _SCHEMA.contiguous_gradients
    reduce_bucket_size: int | str = _SCHEMA.reduce_bucket_size  # int | "auto" (AUTO_SIZED)
    allgather_bucket_size: int = _SCHEMA.allgather_bucket_size
    stage3_prefetch_bucket_size: int | str = _SCHEMA.stage3_prefetch_bucket_size
    stage3_param_persistence_threshold: int | str = _SCHEMA.stage3_param_persistence_threshold
    stage3_max_live_parameters: int = _SCHEMA.stage3_max_live_parameters
    overrides: dict = field(default_factory=dict)
    output_dir: str | None = None  # where deepspeed_config.json is written (rank 0)

    @classmethod
    def from_options(cls, options: dict) -> DeepSpeedSettings:
        """From `build_backend`'s options: cfg.backend as a plain dict, plus `run` (the batch and the run dir)."""
        run = options.get("run") or {}
        missing = [k for k in ("micro_batch_size", "grad_accum_steps") if k not in run]
        if missing:
            raise ValueError(f"the DeepSpeed backend needs options['run'][{missing}] (run.py passes the trainer's)")
        defaults = cls(zero_stage=0, micro_batch_size=1, grad_accum_steps=1)

        def offload(name: str) -> OffloadSettings:
            node = options.get(name) or {}
            return OffloadSettings(**{k: node[k] for k in ("device", "nvme_path", "pin_memory") if k in node})

        plain = {k: options.get(k, getattr(defaults, k)) for k in (
            "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
            "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters")}
        return cls(zero_stage=options.get("zero_stage", 0), micro_batch_size=run["micro_batch_size"],
                   grad_accum_steps=run["grad_accum_steps"], offload_optimizer=offload("offload_optimizer"),
                   offload_param=offload("offload_param"), overrides=dict(options.get("ds_config_overrides") or {}),
                   output_dir=run.get("output_dir"), **plain)


def _is_mapping(node: Any) -> bool:
    return isinstance(node, Mapping)  # OmegaConf's DictConfig is one


def _plain(node: Any) -> dict:
    """An OmegaConf node (or dict) as a plain dict."""
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(node):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return dict(node or {})


def deep_merge(base: dict, overrides: dict) -> dict:
    """A copy of `base` with `overrides` merged in: nested dicts merge key by key, other values replace."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _offload_dict(o: OffloadSettings) -> dict:
    out = {"device": o.device, "pin_memory": o.pin_memory}
    if o.device == "nvme":
        out["nvme_path"] = o.nvme_path
    return out


def model_sized(s: DeepSpeedSettings, hidden_size: int | None) -> dict[str, int]:
    """The AUTO_SIZED values to write: an int as given; "auto" from the hidden size h as in transformers'
    DeepSpeed integration (reduce bucket h², prefetch 0.9·h², persistence threshold 10·h: the norms and
    biases stay whole on every rank, the matrices are partitioned). With no model yet (None) "auto" ones
    are left out: zero.Init, the only reader then, uses none of them (DeepSpeed 0.19 marks persistent
    parameters in `initialize`)."""
    h = hidden_size
    auto = {} if h is None else {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                                 "stage3_param_persistence_threshold": 10 * h}
    sizes = {}
    for name in AUTO_SIZED:
        value = getattr(s, name)
        if value != AUTO:
            sizes[name] = value
        elif name in auto:
            sizes[name] = auto[name]
    return sizes


def bf16_gradient_dtypes(zero_stage: int) -> dict:
    """The DeepSpeed keys that keep bf16 gradients in fp32 where DeepSpeed 0.19.8 allows it, as DDP and
    FSDP2 do (their gradients are fp32). Left alone, DeepSpeed accumulates and reduces them in bf16.

    What each stage then does (gradient dtypes checked by tests/dist/test_deepspeed_bf16.py):
    - ZeRO-0: DeepSpeed refuses `data_types.grad_accum_dtype: fp32` with bf16 weights (NotImplementedError
      "unsupported mix"): micro-batch gradients accumulate in bf16 `param.grad`; the all-reduce runs in fp32
      (`communication_data_type`) and is written back to bf16; the fp32 master update reads it. The one stage
      whose accumulation stays bf16: use ZeRO-1 or later for long accumulation.
    - ZeRO-1: fp32 accumulation makes DeepSpeed use its BF16_Optimizer instead of the ZeRO-1 optimizer: one
      whole fp32 gradient buffer (4 bytes per parameter, not partitioned) that each parameter's bf16 gradient
      is added to as soon as backward produces it (`bf16.immediate_grad_update`: the bf16 copy is freed at
      once; same sums as adding after backward), all-reduced in fp32 at the boundary; each rank updates its
      fp32 master partition. With optimizer offload DeepSpeed keeps its ZeRO-1 optimizer: fp32
      `param.grad_accum`, reduced in fp32 at the boundary.
    - ZeRO-2: the ZeRO-2 optimizer with an fp32 gradient partition: every micro-batch's bf16 gradients are
      bucketed in fp32, reduced to their owner in fp32 and added to the fp32 partition.
    - ZeRO-3: the fp32 gradient partition (`grad_partitions_flat_buffer`), every micro-batch reduce-scattered
      in fp32; parameter all-gathers stay bf16.
    Gradient traffic doubles against bf16 (4 bytes per element). `backend.ds_config_overrides` may set these
    keys back to bf16 (`{data_types: {grad_accum_dtype: bf16}, communication_data_type: bf16}`)."""
    keys: dict[str, Any] = {"communication_data_type": "fp32"}
    if zero_stage >= 1:
        keys["data_types"] = {"grad_accum_dtype": "fp32"}
    if zero_stage == 1:
        keys["bf16"] = {"immediate_grad_update": True}
    return keys


def build_ds_config(s: DeepSpeedSettings, *, dp_size: int, precision: str, max_grad_norm: float,
                    hidden_size: int | None) -> dict:
    """The dict for `deepspeed.initialize(config=...)`: batch triple, clipping, precision, ZeRO, overrides.
    `max_grad_norm` is optim.max_grad_norm: 0 means no clipping, and is written as 0. `hidden_size` is the
    model's, for the "auto" sizes (`model_sized`)."""
    zero: dict[str, Any] = {
        "stage": s.zero_stage,
        "overlap_comm": s.overlap_comm,
        "contiguous_gradients": s.contiguous_gradients,
        "allgather_bucket_size": s.allgather_bucket_size,
        "reduce_scatter": True,
    }
    sizes = model_sized(s, hidden_size)
    zero.update((k, v) for k, v in sizes.items() if s.zero_stage == 3 or not k.startswith("stage3_"))
    if s.zero_stage in (1, 2):
        # DeepSpeed 0.19's default (True) all-reduces each gradient bucket instead of reducing each
        # partition to its owner: twice the traffic.
        zero["use_multi_rank_bucket_allreduce"] = False
    if s.zero_stage >= 1 and s.offload_optimizer.device != "none":
        zero["offload_optimizer"] = _offload_dict(s.offload_optimizer)
    if s.zero_stage == 3:
        zero.update(stage3_max_live_parameters=s.stage3_max_live_parameters,
                    stage3_gather_16bit_weights_on_model_save=True)
        if s.offload_param.device != "none":
            zero["offload_param"] = _offload_dict(s.offload_param)
    config = {
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.grad_accum_steps,
        "train_batch_size": s.micro_batch_size * s.grad_accum_steps * dp_size,
        # Always written: DeepSpeed would clip at 1.0 when the key is absent.
        "gradient_clipping": float(max_grad_norm),
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": zero,
        # Our AdamW and LambdaLR are passed in as client optimizer / scheduler (same lr per step as DDP).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": None,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config = deep_merge(config, bf16_gradient_dtypes(s.zero_stage))
    return deep_merge(config, s.overrides)


def _dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        keys.append(path)
        if isinstance(value, dict):
            keys += _dotted_keys(value, path + ".")
    return keys


def deepspeed_problems(backend: Any, world_size: int) -> list[str]:
    """Every DeepSpeed config problem found without importing DeepSpeed or loading the model."""
    problems = []
    stage = backend.zero_stage
    if stage not in (0, 1, 2, 3):
        problems.append(f"backend.zero_stage={stage} must be 0, 1, 2 or 3")
    for name in ("offload_optimizer", "offload_param"):
        o = getattr(backend, name)
        if o.device not in OFFLOAD_DEVICES:
            problems.append(f"backend.{name}.device={o.device!r} must be one of {', '.join(OFFLOAD_DEVICES)}")
        if o.device == "nvme" and not o.nvme_path:
            problems.append(f"backend.{name}.device=nvme needs backend.{name}.nvme_path=/a/local/nvme/folder")
    if backend.offload_param.device != "none" and stage != 3:
        problems.append(f"backend.offload_param.device={backend.offload_param.device} needs backend.zero_stage=3 "
                        f"(only ZeRO-3 partitions parameters; this run has zero_stage={stage}): "
                        "use backend=zero3_offload")
    if backend.offload_optimizer.device != "none" and stage == 0:
        problems.append(f"backend.offload_optimizer.device={backend.offload_optimizer.device} needs "
                        "backend.zero_stage >= 1 (ZeRO-0 has no partitioned optimizer to offload)")
    for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                 "stage3_param_persistence_threshold", "stage3_max_live_parameters"):
        value, least = getattr(backend, name), 0 if name == "stage3_param_persistence_threshold" else 1
        if name in AUTO_SIZED and value == AUTO:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            may_be = '"auto" (sized from the model\'s hidden size) or ' if name in AUTO_SIZED else ""
            problems.append(f"backend.{name}={value!r} must be {may_be}an integer >= {least}")
    overrides = _plain(backend.ds_config_overrides) if _is_mapping(backend.ds_config_overrides) else {}
    if backend.ds_config_overrides is not None and not _is_mapping(backend.ds_config_overrides):
        problems.append(f"backend.ds_config_overrides={backend.ds_config_overrides!r} must be a mapping "
                        "of DeepSpeed keys, e.g. backend.ds_config_overrides={comms_logger: {enabled: true}}")
    for key in _dotted_keys(overrides):
        if key in OWNED_KEYS:
            problems.append(f"backend.ds_config_overrides.{key} is set by llmtrain from {OWNED_KEYS[key]}; "
                            "set that instead (DeepSpeed and the training loop must agree on it)")
    return problems
