"""Several CLI runs in one process: the imports and start-up (~10 s a launch on 2 CPU cores) are paid once per
launch, not once per run. `python -m tests.dist.workers.batched_runs SPEC.json` (or under torchrun, every rank the
same SPEC): SPEC is a list of {"out": run folder, "args": [CLI overrides]}; each run composes and runs as
`python -m llmtrain ARGS` would, one after the other (a later run may resume an earlier one). Each run's output,
stdout and stderr of every rank, goes to OUT.rank<r>.log beside its folder (tests.helpers.batch_log reads them);
a run that raises writes its traceback to OUT/error_rank<r>.txt. In one process the next run goes on; under torchrun
the rank exits at once, and torchrun stops the others: a peer of the failed rank would otherwise wait in a collective
for trainer.collective_timeout_s (600 s) before the batch went on. The process exits 1 if any run failed;
tests.helpers.run_batch launches it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from pathlib import Path


@contextlib.contextmanager
def output_to(path: Path):
    """File descriptors 1 and 2 (Python's prints, logging, and C++'s output) into PATH while the block runs."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def main(spec_file: str) -> int:
    from llmtrain.compose import compose_config
    from llmtrain.distributed import env_rank, env_world_size
    from llmtrain.run import run

    logging.basicConfig(level=logging.INFO if env_rank() == 0 else logging.WARNING,
                        format=f"[rank{env_rank()}] %(levelname)s %(name)s: %(message)s")
    failed = 0
    for i, spec in enumerate(json.loads(Path(spec_file).read_text())):
        out = Path(spec["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        # each process group of this process under its own key prefix in torchrun's store (llmtrain.parallel's
        # _restart_safe_store names it after the attempt): a rank must not read a peer's address from the last run
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(i)
        with output_to(out.parent / f"{out.name}.rank{env_rank()}.log"):
            try:
                run(compose_config([*spec["args"], f"output_dir={out}"]))
            except Exception:  # noqa: BLE001 (reported in the run's folder; the test names the run)
                failed += 1
                out.mkdir(parents=True, exist_ok=True)
                (out / f"error_rank{env_rank()}.txt").write_text(traceback.format_exc())
                print(f"{out.name}: failed\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if failed and env_world_size() > 1:
            print(f"{out.name} failed on rank {env_rank()}: the launch stops here, its later runs do not start",
                  file=sys.stderr, flush=True)
            break
        if "deepspeed.utils.groups" in sys.modules:  # DeepSpeed keeps the last run's (destroyed) groups otherwise
            sys.modules["deepspeed.utils.groups"]._release_process_group_references()
    return 1 if failed else 0


if __name__ == "__main__":
    from llmtrain.distributed import exit_process

    exit_process(main(sys.argv[1]))
