"""Run by tests/gpu/test_liger.py: `python -m tests.gpu.workers.count_liger CALLS_JSON ARGS...` is
`python -m llmtrain ARGS...` with Liger's fused linear cross-entropy (liger_kernel.transformers.functional.
liger_fused_linear_cross_entropy, which models/liger.py imports at each call) wrapped to record every call: the
device of its hidden states, the shape and the loss. The calls are written to CALLS_JSON before the process exits,
so the test sees whether the kernel ran, not what the log says."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path


def counted(calls: list[dict]):
    from liger_kernel.transformers import functional

    original = functional.liger_fused_linear_cross_entropy

    @functools.wraps(original)  # keeps the signature models/liger.py inspects (accum_dtype)
    def wrapper(hidden, weight, *args, **kwargs):
        loss = original(hidden, weight, *args, **kwargs)
        calls.append({"device": hidden.device.type, "tokens": hidden.shape[0], "vocab": weight.shape[0],
                      "loss": float(loss.detach())})
        return loss

    functional.liger_fused_linear_cross_entropy = wrapper


def run(calls_file: Path, args: list[str]) -> int:
    from llmtrain.__main__ import main

    calls: list[dict] = []
    counted(calls)
    try:
        return main(args)
    finally:
        calls_file.write_text(json.dumps(calls))


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]), sys.argv[2:]))
