"""DeepSpeed's just-in-time ops (torch cpp extensions): name stale build locks, and build the ops ahead of a launch.

Every rank of a DeepSpeed run loads its ops (on CPU: the shared-memory communicator at init, cpu_adam for
optimizer offload, async_io for NVMe). The first load compiles under a lock file in the extensions directory; a
build killed half-way leaves that lock behind and every later run waits on it forever, without a word.

    python -m llmtrain.backends.deepspeed_ops          # build the ops this machine's accelerator uses, once
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

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


def prebuild(names: tuple[str, ...] | None = None) -> dict[str, str]:
    """Build (or load from the cache) each op in one process: {op: 'built' | why it cannot build here}."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    results = {}
    for name in names or OPS_BY_ACCELERATOR.get(accelerator.device_name(), ()):
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            results[name] = "not compatible here"
            continue
        started = time.perf_counter()
        try:
            builder.load(verbose=False)
            results[name] = f"built ({time.perf_counter() - started:.0f} s)"
        except Exception as error:  # noqa: BLE001 - a build fails in many ways; the run reports it when it needs it
            results[name] = f"cannot build: {error}"
    return results


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warn_stale_build_locks()
    for name, outcome in prebuild(tuple(sys.argv[1:]) or None).items():
        print(f"{name}: {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
