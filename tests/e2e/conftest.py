"""Fixtures shared by the e2e tests: the Jupyter kernel the notebook tests run notebooks/ with."""

from __future__ import annotations

import subprocess
import sys

import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
    """'python3' where that kernelspec starts this interpreter, else a throwaway kernelspec that does."""
    try:
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except NoSuchKernel:
        argv0 = None
    # jupyter_client itself replaces a bare python/python3/python3.X with sys.executable.
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    if argv0 in bare or (argv0 and _prefix_of(argv0) == sys.prefix):
        return "python3"
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(tmp_path / "kernels" / "llmtrain-test")  # argv[0] is sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "llmtrain-test"


def _prefix_of(python: str) -> str | None:
    try:
        result = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                                timeout=30)
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None
