"""Run by tests/e2e/test_reference_loop.py in a subprocess:
`python -m tests.e2e.workers.capture_batches capture OUT_FILE LLMTRAIN_ARGS...` runs llmtrain's CLI in this process
and saves (torch.save) every micro-batch the trainer fetched to OUT_FILE."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def capture(out_file: Path, args: list[str]) -> int:
    """Run llmtrain's CLI in this process, recording every batch the trainer fetches before it is moved to the
    device and given its attention inputs (the run has no eval, so these are the training micro-batches)."""
    import llmtrain.run
    from llmtrain.__main__ import main

    recorded = []
    make_preparer = llmtrain.run.batch_preparer

    def recording_preparer(*a, **k):
        prepare = make_preparer(*a, **k)

        def record_then_prepare(batch):
            recorded.append({"input_ids": batch.input_ids.clone(), "labels": batch.labels.clone(),
                             "attention_mask": None if batch.attention_mask is None else batch.attention_mask.clone(),
                             "position_ids": None if batch.position_ids is None else batch.position_ids.clone(),
                             "seq_lens": None if batch.seq_lens is None else [list(r) for r in batch.seq_lens]})
            return prepare(batch)

        return record_then_prepare

    llmtrain.run.batch_preparer = recording_preparer
    code = main(args)
    torch.save(recorded, out_file)
    return code


if __name__ == "__main__":
    assert sys.argv[1] == "capture"
    sys.exit(capture(Path(sys.argv[2]), sys.argv[3:]))
