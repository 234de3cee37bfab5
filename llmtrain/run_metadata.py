"""What a run records about itself in config.yaml: versions, git SHA, world, devices.

Only values llmtrain chooses to record go in; never the environment, so credentials
(WANDB_API_KEY, HF_TOKEN, ...) cannot reach the run dir.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
from pathlib import Path

import torch

PACKAGES = ("llmtrain", "torch", "transformers", "datasets", "tokenizers", "deepspeed", "peft", "hydra-core",
            "wandb", "numpy")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_metadata(world_size: int, backend: str, device: torch.device, precision: str) -> dict:
    devices = (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    return {"versions": package_versions(), "git_sha": git_sha(), "world_size": world_size, "backend": backend,
            "device": str(device.type), "device_name": devices, "precision": precision}
