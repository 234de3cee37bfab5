"""Loss spikes caught on 2 ranks (torchrun, gloo, DDP, fp32), tiny SFT recipe: trainer.spike.policy=rollback and skip,
each with an injected bad batch on ONE rank (LLMTRAIN_TEST_FAULT kind=bad_batch: every position a target of a token
the data never holds), so only the globally reduced loss can tell the other rank.

Two launches. `rolled`: 12 steps, checkpoints every 4, max_rollbacks=1, the bad batch on rank 1 at step 7 -> both
ranks call the spike at step 7, reload step_4, skip data positions 4..6 (steps 5-7's windows) and train steps 5..11 on
positions 7..13; a second bad batch (rank 0, step 12) is one rollback too many: every rank stops with exit code 3.
`clean`: resumes from a copy of step_4 whose data position is 3 windows on (`data_offset`), so its data never holds
those windows; policy=skip with a bad batch on rank 0 at step 12. Its steps 5..11 equal the rolled-back run's bit for
bit (losses and the running statistic's ratio: restored with the checkpoint), and its step 12 changes no weight.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_ok, cli_env, read_metrics, run_cli, worker_exit_codes

pytestmark = pytest.mark.dist

ARGS = ["recipe=sft_tiny", "trainer.max_steps=12", "trainer.keep_last_k=3", "trainer.eval_every_n_steps=0",
        "data.eval_files=[]", "data.eval_fraction=0", "trainer.log_every_n_steps=0", "optim.warmup_steps=0",
        "optim.lr=5e-3", "trainer.spike.factor=1.5", "trainer.spike.warmup_steps=3"]
GLOBAL_BATCH, SEED, TRAIN_EXAMPLES = 64, 1234, 4000  # sft_tiny: 32 rows × 2 ranks; reverse_train.jsonl's rows


def by_step(run_dir: Path) -> dict[int, dict]:
    """The last record of each step (a rollback replays the steps after its checkpoint)."""
    return {r["step"]: r for r in read_metrics(run_dir)[0]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("spikes")
    rolled = run_cli([*ARGS, "trainer.save_every_n_steps=4", "trainer.spike.policy=rollback",
                      "trainer.spike.max_rollbacks=1", f"output_dir={root / 'rolled'}"], nproc=2,
                     env=cli_env(LLMTRAIN_TEST_FAULT="rank=1,step=7,kind=bad_batch;rank=0,step=12,kind=bad_batch"))
    assert rolled.returncode != 0 and set(worker_exit_codes(rolled.stderr)) <= {3, -15}, rolled.stderr[-3000:]
    start = root / "step_4_skipping_3_windows"  # the comparison's data position: 4 steps + 3 skipped windows
    shutil.copytree(root / "rolled" / "checkpoints" / "step_4", start)
    state = json.loads((start / "trainer.json").read_text())
    assert state["data_offset"] == 0
    (start / "trainer.json").write_text(json.dumps({**state, "data_offset": 3}))
    clean = run_cli([*ARGS, "trainer.save_every_n_steps=11", "trainer.spike.policy=skip", f"resume={start}",
                     f"output_dir={root / 'clean'}"], nproc=2,
                    env=cli_env(LLMTRAIN_TEST_FAULT="rank=0,step=12,kind=bad_batch"))
    assert_ok(clean)
    return {"root": root, "rolled": rolled, "clean": clean}


def test_a_spike_on_one_rank_is_rolled_back_on_every_rank_and_its_data_skipped(runs):
    rolled, out = runs["rolled"], runs["root"] / "rolled"
    assert "test fault: bad batch at step 7 on rank 1" in rolled.stderr
    assert "test fault: bad batch at step 7 on rank 0" not in rolled.stderr
    for rank in (0, 1):  # each rank decided by itself, at the same step, on the same value
        assert f"[rank{rank}] WARNING llmtrain.spikes: step 7: spike: loss=" in rolled.stderr, rolled.stderr[-3000:]
        assert f"[rank{rank}] WARNING llmtrain.spikes: step 7: loss spike: rolled back to step_4 (rollback 1 of at " \
               "most 1); data positions 4..6 skipped" in rolled.stderr
    records = read_metrics(out)[0]
    assert [r["step"] for r in records] == [*range(1, 8), *range(5, 13)]
    assert [r["spike"] for r in records] == [0] * 6 + [1] + [0] * 7 + [1]
    assert min(records[6]["spike_ratio"], records[-1]["spike_ratio"]) > 1.5 > max(
        r.get("spike_ratio", 0) for r in records if not r["spike"])
    assert records[-2]["spike_rollbacks"] == 1 and records[-2]["spikes"] == 1
    latest = json.loads((out / "checkpoints" / "step_8" / "trainer.json").read_text())
    assert latest["data_offset"] == 3 and latest["spike"]["rollbacks"] == 1 and latest["parent"] == "step_4"
    # the skipped examples, against the sampler's definition: epoch 0 visits randperm(N, seed) in windows of G
    perm = torch.randperm(TRAIN_EXAMPLES, generator=torch.Generator().manual_seed(SEED))
    listed = [json.loads(line) for line in (out / "skipped_data.jsonl").read_text().splitlines()]
    assert listed == [{"spike_step": 7, "rolled_back_to": "step_4", "data_positions": [4, 7],
                       "examples": [perm[p * GLOBAL_BATCH:(p + 1) * GLOBAL_BATCH].tolist() for p in (4, 5, 6)]}]


def test_a_run_that_keeps_spiking_stops_every_rank_naming_the_limit(runs):
    rolled, out = runs["rolled"], runs["root"] / "rolled"
    for rank in (0, 1):
        assert f"llmtrain: stopped on rank {rank}: step 12: a loss spike after trainer.spike.max_rollbacks=1 " \
               f"rollbacks; every rank stops here. The data skipped so far is listed in {out / 'skipped_data.jsonl'}" \
               in rolled.stderr, rolled.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_8" and not (out / "hf").exists()


def test_after_the_rollback_the_run_equals_one_whose_data_never_had_the_window(runs):
    rolled, clean = by_step(runs["root"] / "rolled"), by_step(runs["root"] / "clean")
    assert sorted(clean) == list(range(5, 13))
    for step in range(5, 12):
        assert (rolled[step]["loss"], rolled[step]["spike_ratio"]) == (clean[step]["loss"], clean[step]["spike_ratio"])
    assert all(clean[step]["spike"] == 0 for step in range(5, 12))


def test_a_skipped_spike_changes_no_weight_and_is_counted(runs):
    clean, out = runs["clean"], runs["root"] / "clean"
    for rank in (0, 1):
        assert f"[rank{rank}] WARNING llmtrain.spikes: step 12: spike: loss=" in clean.stderr, clean.stderr[-3000:]
        assert "policy skip" in clean.stderr
    last = by_step(out)[12]
    assert (last["spike"], last["spike_skipped_steps"], last["spike_rollbacks"]) == (1, 1, 0)
    assert not (out / "skipped_data.jsonl").exists()
    before, after = (out / "checkpoints" / f"step_{s}" / "engines" / "policy" for s in (11, 12))
    load = lambda directory, name: torch.load(directory / name, weights_only=True)  # noqa: E731
    assert_equal_tree(load(before, "model.pt"), load(after, "model.pt"))
    # Adam's moments and step count; the lr in its param groups moves on (the schedule follows the step count)
    assert_equal_tree(load(before, "optimizer.pt")["state"], load(after, "optimizer.pt")["state"])


def assert_equal_tree(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_equal_tree(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_tree(x, y)
    else:
        assert a == b
