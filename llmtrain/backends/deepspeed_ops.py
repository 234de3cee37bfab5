"""DeepSpeed's just-in-time ops (torch cpp extensions): the ones a run needs (checked before the model loads, or a
fallback), stale build locks named, and the ops built ahead of a launch.

Every rank of a DeepSpeed run loads its ops (on CPU: the shared-memory communicator at init, cpu_adam for
optimizer offload, async_io for NVMe). The first load compiles under a lock file in the extensions directory; a
build killed half-way leaves that lock behind and every later run waits on it forever, without a word.

    python -m llmtrain.backends.deepspeed_ops          # build the ops this machine's accelerator uses, once
    MAX_JOBS=1 python -m llmtrain.backends.deepspeed_ops --jobs 1   # one compiler at a time (CI)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

from llmtrain.backends.base import OptimizerSpec, param_groups
from llmtrain.backends.deepspeed_config import DeepSpeedSettings
from llmtrain.config import ConfigError
from llmtrain.optim.build import build_optimizer

log = logging.getLogger(__name__)

STALE_AFTER_S = 15 * 60  # no op takes this long to build on one core
OPS_BY_ACCELERATOR = {
    "cpu": ("ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder", "PinMemoryBuilder"),
    "cuda": ("FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder"),
}


def extensions_root() -> Path:
    """Where torch builds cpp extensions: TORCH_EXTENSIONS_DIR/<op>, else ~/.cache/torch_extensions/<py>_<dev>/<op>."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def stale_build_locks(root: Path, now: float | None = None) -> list[Path]:
    """Lock files of op builds under `root` older than STALE_AFTER_S: left by a build that was killed."""
    now = time.time() if now is None else now
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    return sorted(lock for lock in locks if now - lock.stat().st_mtime > STALE_AFTER_S)


def warn_stale_build_locks() -> None:
    root = extensions_root()
    for lock in stale_build_locks(root) if root.is_dir() else []:
        age_min = (time.time() - lock.stat().st_mtime) / 60
        log.warning("%s is %.0f min old: a DeepSpeed op build was killed half-way and this run will wait on it "
                    "forever. Delete it (rm %s) when no other build runs on this machine", lock, age_min, lock)


def build_op(name: str) -> str:
    """Build (or load from the cache) one op: 'built (N s)' or why it cannot build here."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    if builder is None or not builder.is_compatible(verbose=False):
        return "not compatible here"
    started = time.perf_counter()
    try:
        builder.load(verbose=False)
    except Exception as error:  # noqa: BLE001 - a build fails in many ways; the run reports it when it needs it
        return f"cannot build: {error}"
    return f"built ({time.perf_counter() - started:.0f} s)"


def prebuild(names: tuple[str, ...] | None = None, jobs: int | None = None) -> dict[str, str]:
    """Build each op in its own process, JOBS at a time (default: all at once), in order: {op: outcome}. Each op
    compiles under its own lock in its own folder (ninja runs MAX_JOBS compilers of one op at once, default cores + 2).
    Where other work already fills the cores (CI builds beside the tests), `jobs=1` with MAX_JOBS=1 runs one compiler
    in all, leaving the cores to that work rather than crowding them."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    if names is None:
        from deepspeed.accelerator import get_accelerator

        names = OPS_BY_ACCELERATOR.get(get_accelerator().device_name(), ())
    workers = max(1, jobs or len(names))
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        return dict(zip(names, pool.map(build_op, names)))


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as error:  # pragma: no cover
        raise ConfigError("backend.name=deepspeed needs DeepSpeed: pip install 'llmtrain[deepspeed]'") from error
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO dump of every config key
    return deepspeed


def check_ops(settings: DeepSpeedSettings) -> None:
    """NVMe offload needs DeepSpeed's async_io op (libaio): fail before the model loads if it cannot build."""
    if "nvme" not in (settings.offload_optimizer.device, settings.offload_param.device):
        return
    import_deepspeed()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    reason = None
    if not builder.is_compatible(verbose=False):
        reason = "libaio was not found (Debian/Ubuntu: apt-get install libaio-dev)"
    else:
        try:
            builder.load(verbose=False)
        except Exception as error:  # noqa: BLE001 - any build failure is reported as such
            reason = f"building it failed: {error}"
    if reason:
        raise ConfigError(f"backend.offload_*.device=nvme needs DeepSpeed's async_io op, which cannot build here: "
                          f"{reason}. Install libaio-dev, or use device=cpu")


def build_offload_adam(model: torch.nn.Module, spec: OptimizerSpec):
    """(optimizer, note): DeepSpeedCPUAdam over our AdamW groups, or torch AdamW when its op cannot build."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(param_groups(model, spec.weight_decay), lr=spec.lr, betas=spec.betas,
                                     eps=spec.eps, adamw_mode=True, bias_correction=True)
        return optimizer, "DeepSpeedCPUAdam"
    except Exception as error:  # noqa: BLE001 - the op build can fail in many ways (no compiler, no headers)
        log.warning("optimizer offload: DeepSpeed's cpu_adam op cannot build here (%s); FALLBACK: torch.optim.AdamW "
                    "runs on the host instead (same maths, slower); zero_force_ds_cpu_optimizer=false", error)
        return build_optimizer(model, spec), "torch.optim.AdamW (fallback: cpu_adam op did not build)"


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m llmtrain.backends.deepspeed_ops",
                                     description="Build DeepSpeed's ops this machine's accelerator uses, once.")
    parser.add_argument("ops", nargs="*", help="builder names (default: this accelerator's, e.g. CPUAdamBuilder)")
    parser.add_argument("--jobs", type=int, default=None, help="ops built at a time (default: all at once)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warn_stale_build_locks()
    for name, outcome in prebuild(tuple(args.ops) or None, args.jobs).items():
        print(f"{name}: {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
