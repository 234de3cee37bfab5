"""DDP under torchrun (gloo): 2 ranks × micro b equals 1 process × 2b, gradient accumulation changes nothing,
and bitwise resume (1 and 2 ranks).

Every run loads the same saved tiny model folder, and runs once per module (`runs`: one launch per rank count,
its runs one after the other), serving every test that reads it. Parity compares loss and grad norm per step
(grad norm catches a gradient-scale bug that Adam would hide in the loss). The runs' arguments (`base_args`) and
the per-step comparison (`assert_close_series`) are fixtures of tests/dist/conftest.py, shared with the other
backends' tests.
"""

from __future__ import annotations

import pytest

from tests.helpers import REPO, BatchedRuns, read_metrics

pytestmark = pytest.mark.dist


# 10 steps of global batch 16 in fp32, dropout 0, eval at steps 0, 5, 10 on 9 held-out samples (not divisible by 2
# ranks or by the eval batch of 4); EVAL_FILE is written by the `runs` fixture.
EVAL_FILE = "eval.jsonl"
PARITY = ["trainer.max_steps=10", "trainer.grad_accum_steps=2", "trainer.save_every_n_steps=0",
          f"data.eval_files=[{{root}}/{EVAL_FILE}]", "trainer.eval_every_n_steps=5", "trainer.eval_batch_size=4"]


def resume_args(nproc: int) -> list[str]:
    """12 steps, accumulation 2, dropout 0.1, saved at step 6."""
    return ["trainer.max_steps=12", "trainer.grad_accum_steps=2", f"trainer.micro_batch_size={8 // nproc}",
            "model.dropout=0.1", "trainer.save_every_n_steps=6", "trainer.keep_last_k=3"]


RUNS = {  # name -> (nproc, overrides); each resumed run after the run whose step 6 it loads, another run between
    "straight_1": (1, resume_args(1)),
    "straight_2": (2, resume_args(2)),
    "single": (1, [*PARITY, "trainer.micro_batch_size=8"]),
    "ddp": (2, [*PARITY, "trainer.micro_batch_size=4", "trainer.global_batch_size=16"]),
    "single_accum16": (1, [*PARITY, "trainer.micro_batch_size=1", "trainer.grad_accum_steps=16"]),
    **{f"resumed_{n}": (n, [*resume_args(n), f"resume={{root}}/straight_{n}/checkpoints/step_6", "data.num_workers=2"])
       for n in (1, 2)},
    # trainer.async_save: rank 0's host copy written on a thread while steps 7.. train, resumed (saving so too)
    "async_2": (2, [*resume_args(2), "trainer.async_save=true"]),
    "resumed_async_2": (2, [*resume_args(2), "trainer.async_save=true", "resume={root}/async_2/checkpoints/step_6"]),
}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory, base_args):
    """Every run of RUNS, in one launch per rank count (tests/dist/workers/batched_runs.py); `runs(name)` is the
    folder of a run that finished."""
    root = tmp_path_factory.mktemp("ddp")
    (root / EVAL_FILE).write_text(
        "".join((REPO / "llmtrain/assets/data/reverse_eval.jsonl").read_text().splitlines(True)[:9]))
    return BatchedRuns(root, [(nproc, [(name, base_args(tiny_model_dir, root / name,
                                                      *(a.replace("{root}", str(root)) for a in args)))
                                       for name, (n, args) in RUNS.items() if n == nproc]) for nproc in (1, 2)])


def test_ddp_two_ranks_match_one_process(runs, assert_close_series):
    reference, ours = read_metrics(runs("single"))[0], read_metrics(runs("ddp"))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-5)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]
    # every held-out sample counted exactly once across ranks: same tokens, same loss
    eval_reference, eval_ours = read_metrics(runs("single"))[1], read_metrics(runs("ddp"))[1]
    assert [e["step"] for e in eval_ours] == [0, 5, 10]
    assert [e["eval_tokens"] for e in eval_ours] == [e["eval_tokens"] for e in eval_reference]
    assert_close_series(eval_ours, eval_reference, "eval_loss", 1e-6, 1e-5)


def test_accumulation_does_not_change_the_step(runs, assert_close_series):
    """One process: 16 micro-batches of 1 row (no padding) per step equal 2 of 8 rows, loss and grad norm of
    every step to 1e-6 relative, and the eval losses after training too."""
    reference, ours = read_metrics(runs("single"))[0], read_metrics(runs("single_accum16"))[0]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in reference]
    assert_close_series(ours, reference, "loss", 1e-6, 1e-6)
    assert_close_series(ours, reference, "grad_norm", 1e-6, 1e-6)
    assert_close_series(read_metrics(runs("single_accum16"))[1], read_metrics(runs("single"))[1], "eval_loss",
                        1e-6, 1e-6)


@pytest.mark.parametrize("nproc,saved", [(1, "straight"), (2, "straight"), (2, "async")])
def test_bitwise_resume(runs, nproc, saved):
    """12 steps straight vs the same run's step-6 checkpoint resumed in a later run (other runs between): identical
    losses. Accumulation 2, dropout 0.1, mid-epoch; the resumed half also uses 2 data workers. `async`: checkpoints
    written in the background (trainer.async_save); that run itself equals the straight one bit for bit."""
    straight, resumed = runs(f"{saved}_{nproc}"), runs(f"resumed_{nproc}" if saved == "straight" else "resumed_async_2")
    reference = read_metrics(straight)[0]
    continued = read_metrics(resumed)[0]
    synchronous = read_metrics(runs(f"straight_{nproc}"))[0]
    assert [(r["loss"], r["grad_norm"]) for r in reference] == [(r["loss"], r["grad_norm"]) for r in synchronous]
    assert [r["step"] for r in continued] == list(range(7, 13))
    assert [r["loss"] for r in continued] == [r["loss"] for r in reference[6:]]
    assert [r["grad_norm"] for r in continued] == [r["grad_norm"] for r in reference[6:]]
    # dropout is really on: step 1 of the parity run (dropout 0: the same weights, batch, lr and layout) has
    # another loss (dropout 0.1 moves it by ~4e-4 relative; two runs of one config agree exactly)
    without_dropout = read_metrics(runs("single" if nproc == 1 else "ddp"))[0][0]
    assert without_dropout["tokens"] == reference[0]["tokens"] and without_dropout["lr"] == reference[0]["lr"]
    assert abs(without_dropout["loss"] - reference[0]["loss"]) > 1e-5 * reference[0]["loss"]
