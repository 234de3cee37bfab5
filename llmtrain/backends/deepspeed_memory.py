"""Model-state bytes a DeepSpeed engine really holds on its rank, measured at the first optimizer step, next to
metrics/memory.deepspeed_expected's formula (backends/deepspeed.py calls these; no deepspeed import here)."""

from __future__ import annotations

import logging

import torch

from llmtrain.backends.deepspeed_config import DeepSpeedSettings
from llmtrain.metrics.memory import StorageLedger, deepspeed_expected, formula_16m

log = logging.getLogger("llmtrain.backends.deepspeed")  # the engine's: these lines are its report

# What each tensor-holding attribute of DeepSpeed's ZeRO optimizers (0.19) is. Claimed in this order,
# each storage once; anything left over is measured as "other" under its attribute name.
DS_ROLES = (
    ("params", ("bit16_groups_flat", "bit16_groups", "parallel_partitioned_bit16_groups", "fp16_groups",
                "fp16_partitioned_groups_flat", "fp16_partitioned_groups", "persistent_parameters",
                "lp_param_buffer", "param_groups_fp16_flat_cpu_memory")),
    ("master", ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                "fp32_groups_flat_partition",  # BF16_Optimizer (ZeRO-1 under bf16)
                "fp32_groups")),  # FP16_UnfusedOptimizer (ZeRO-0 under bf16/fp16)
    ("grads", ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer", "offload_gradient_dict",
               "all_grad_tensors", "fp32_groups_gradients_flat")),
    ("buffers", ("ipg_buckets", "ipg_buffer", "temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload",
                 "param_buffer_of_bit16_for_cpu_offload_groups", "norm_for_param_grads", "_global_grad_norm",
                 "inf_or_nan_tracker", "grad_position", "small_grad_partitions")),
)


def storage_ledger(opt, model: torch.nn.Module) -> StorageLedger:
    """Every tensor this rank holds for the model (`opt`: DeepSpeed's ZeRO optimizer), by role, each storage once."""
    ledger = StorageLedger()
    for p in model.parameters():
        ledger.add("params", "module parameters", [p.data, getattr(p, "ds_tensor", None)])
        ledger.add("grads", "module .grad", [p.grad])
    for role, names in DS_ROLES:
        for name in names:
            value = getattr(opt, name, None)
            if name == "ipg_buckets" and isinstance(value, dict):
                value = [vars(bucket) for bucket in value.values()]
            ledger.add(role, name, value)
    inner = getattr(opt, "optimizer", opt)  # the torch / DeepSpeedCPUAdam optimizer inside ZeRO
    ledger.add("optim", "optimizer state", list(inner.state.values()))
    for name, value in vars(opt).items():
        if name not in ("optimizer", "param_names"):
            ledger.add("other", name, value)
    return ledger


def _host_bytes(measured: dict, settings: DeepSpeedSettings, model: torch.nn.Module) -> float:
    """What offload keeps in host memory: master + Adam (+ ZeRO-3 gradients), and ZeRO-3's weight partitions."""
    stage = settings.zero_stage
    offload_opt, offload_param = settings.offload_optimizer.device != "none", settings.offload_param.device != "none"
    host_roles = (("master", "optim") + (("grads",) if stage == 3 else ())) if offload_opt else ()
    host = sum(measured[r] for r in host_roles)
    if offload_param and stage == 3:  # the weight partitions (ds_tensor) live in host memory
        partitions = StorageLedger()
        partitions.add("params", "ds_tensor", [getattr(p, "ds_tensor", None) for p in model.parameters()])
        host += partitions.bytes["params"]
    return host


def measure_model_states(ds, model: torch.nn.Module, settings: DeepSpeedSettings, grad_peak: dict, dp_size: int,
                         is_main: bool) -> dict[str, float]:
    """The report of model_state_bytes(): measured bytes per role (gradients and buckets at their peak over the
    micro-batches, `grad_peak`), the expected ones next to them, and the unadjusted 16M formula."""
    ledger, stage, s = storage_ledger(ds.optimizer, model), settings.zero_stage, settings
    measured = {role: float(ledger.bytes[role]) for role in ("params", "master", "optim", "other")}
    measured.update({role: float(max(grad_peak.get(role, 0), ledger.bytes[role])) for role in ("grads", "buffers")})
    if ledger.bytes["other"]:
        log.warning("model-state bytes: %d bytes in DeepSpeed attributes llmtrain does not classify: %s",
                    ledger.bytes["other"], sorted(ledger.names["other"]))
    measured["host"] = _host_bytes(measured, s, model)
    numels = [getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad]
    frozen = [getattr(p, "ds_numel", p.numel()) for p in model.parameters() if not p.requires_grad]  # LoRA
    threshold = ds.zero_param_persistence_threshold()
    persistent = sum(n for n in numels if n <= threshold) if stage == 3 else 0
    frozen_persistent = sum(n for n in frozen if n <= threshold) if stage == 3 else 0
    expected = deepspeed_expected(num_params=sum(numels), persistent_params=persistent, stage=stage, dp=dp_size,
                                  grad_accum_steps=s.grad_accum_steps,
                                  offload_optimizer=s.offload_optimizer.device != "none",
                                  offload_param=s.offload_param.device != "none", frozen_params=sum(frozen),
                                  frozen_persistent_params=frozen_persistent)
    roles = ("params", "master", "grads", "optim")
    report = {f"{r}_bytes": measured[r] for r in (*roles, "buffers", "other", "host")}
    report.update({f"expected_{r}_bytes": expected[r] for r in (*roles, "host")})
    report["total_bytes"] = sum(measured[r] for r in roles)
    report["expected_total_bytes"] = sum(expected[r] for r in roles)
    report["formula_16m_bytes"] = formula_16m(num_params=sum(numels), stage=stage, dp=dp_size)
    if is_main:
        log.info("model-state bytes on rank 0 (measured / expected): %s; host %d / %d; buckets apart %d",
                 ", ".join(f"{r} {measured[r]:.0f} / {expected[r]:.0f}" for r in roles), measured["host"],
                 expected["host"], measured["buffers"])
    return report
