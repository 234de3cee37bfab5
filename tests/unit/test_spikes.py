"""trainer.spike (llmtrain/spikes.py): the running statistic and the decision, its state across a save, the config
checks, the bad-batch test fault, and the rollback's limits. The end-to-end runs on 2 ranks:
tests/dist/test_spikes.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.data.collate import Batch
from llmtrain.faults import _parse_fault, corrupt_batches
from llmtrain.metrics.sinks import wandb_key
from llmtrain.spikes import SpikeError, SpikeMonitor, SpikeRule, is_spike, roll_back, spike_ratio, window_examples
from llmtrain.validation import validate

CPU = torch.device("cpu")


def test_ratio_is_against_the_median_after_the_warm_up():
    assert spike_ratio(9.0, [1.0, 2.0, 3.0], warmup_steps=4, seen=3) is None  # still warming up
    assert spike_ratio(9.0, [1.0, 2.0, 3.0, 100.0], warmup_steps=4, seen=4) == 9.0 / 2.5  # a spike moves no median
    assert spike_ratio(1.0, [-1.0, -2.0, 0.5], warmup_steps=1, seen=3) is None  # no positive level to compare with
    assert is_spike(3.01, 3.0) and not is_spike(3.0, 3.0) and not is_spike(None, 3.0)


def feed(monitor: SpikeMonitor, values: list[float], first_step: int = 1) -> list[bool]:
    accepted = []
    for step, value in enumerate(values, first_step):
        monitor.begin_step(step)
        accepted.append(monitor.accept(value, grad_norm=0.0))
    return accepted


def test_skip_refuses_the_spike_counts_it_and_the_window_keeps_its_last_values():
    monitor = SpikeMonitor(SpikeRule(policy="skip", factor=2.0, window=3, warmup_steps=3), CPU)
    assert feed(monitor, [4.0, 3.0, 2.0, 2.0, 4.5, 2.0]) == [True] * 4 + [False, True]  # 4.5 > 2 × median(3, 2, 2)
    assert monitor.windows == [[2.0, 4.5, 2.0]] and monitor.seen == [6]
    assert (monitor.spikes, monitor.spike_skipped_steps, monitor.rollbacks) == (1, 1, 0)
    assert monitor.record() == {"spike": 0, "spikes": 1, "spike_skipped_steps": 1, "spike_rollbacks": 0,
                                "spike_ratio": 2.0 / 2.0}
    assert {wandb_key(key, "ppo") for key in monitor.record()} == {  # W&B: train/, whatever the stage's group
        "train/spike", "train/spikes", "train/spike_skipped_steps", "train/spike_rollbacks", "train/spike_ratio"}


def test_log_applies_the_update_rollback_asks_for_one_and_grad_norm_can_be_watched():
    logged = SpikeMonitor(SpikeRule(policy="log", factor=2.0, warmup_steps=2), CPU)
    assert feed(logged, [1.0, 1.0, 5.0]) == [True, True, True] and logged.step_spike and not logged.rollback_pending
    rolled = SpikeMonitor(SpikeRule(policy="rollback", factor=2.0, warmup_steps=2), CPU)
    assert feed(rolled, [1.0, 1.0, 5.0]) == [True, True, False] and rolled.rollback_pending
    assert rolled.spike_skipped_steps == 0  # a rollback is counted when the trainer does it
    norms = SpikeMonitor(SpikeRule(policy="skip", metric="grad_norm", factor=2.0, warmup_steps=1), CPU)
    norms.begin_step(1)
    assert norms.accept(100.0, grad_norm=1.0)
    norms.begin_step(2)
    assert not norms.accept(1.0, grad_norm=3.0)


def test_each_update_of_a_step_has_its_own_window():
    """PPO updates its actor and critic (and several mini-batches) per step: the k-th update is compared with the
    k-th updates of the steps before, not with another role's loss."""
    monitor = SpikeMonitor(SpikeRule(policy="skip", factor=2.0, warmup_steps=2), CPU)
    for step in (1, 2, 3):
        monitor.begin_step(step)
        assert monitor.accept(1.0, 0.0) and monitor.accept(50.0, 0.0)  # two levels, neither a spike of its own
    assert monitor.windows == [[1.0] * 3, [50.0] * 3]


def test_the_state_survives_json_and_decides_the_same():
    """trainer.json carries the state: a resumed monitor makes the straight run's decisions, ratios bit for bit."""
    rule = SpikeRule(policy="skip", factor=1.2, window=4, warmup_steps=3)
    values = [5.539253, 5.075674, 4.104648, 3.675627, 3.4498, 7.0218, 3.3324, 3.29104, 3.1]
    straight = SpikeMonitor(rule, CPU)
    decisions, ratios = [], []
    for step, value in enumerate(values, 1):
        straight.begin_step(step)
        decisions.append(straight.accept(value, 0.0))
        ratios.append(straight.step_ratio)
    first = SpikeMonitor(rule, CPU)
    feed(first, values[:5])
    resumed = SpikeMonitor(rule, CPU)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for step, value in enumerate(values[5:], 6):
        resumed.begin_step(step)
        assert resumed.accept(value, 0.0) == decisions[step - 1] and resumed.step_ratio == ratios[step - 1]
    assert resumed.state_dict() == straight.state_dict() and decisions.count(False) == 1


def problems_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        validate(compose_config(["recipe=sft_tiny", *overrides]), 1)
    return str(error.value)


def test_bad_spike_settings_name_the_field_and_the_fix():
    """All reported together, before anything loads (one composition each, to spare CI time)."""
    text = problems_of("trainer.spike.policy=rollback", "trainer.spike.factor=1.0", "trainer.spike.window=0",
                       "trainer.spike.warmup_steps=0", "trainer.save_every_n_steps=0", "trainer.spike.max_rollbacks=0")
    for needle in ("trainer.spike.factor=1.0 must be > 1", "trainer.spike.window=0 must be >= 1",
                   "trainer.spike.warmup_steps=0 must be >= 1", "trainer.spike.max_rollbacks=0 must be >= 1",
                   "trainer.spike.policy=rollback needs checkpoints to roll back to, but trainer.save_every_n_steps=0: "
                   "set it >= 1, or use policy=skip"):
        assert needle in text
    text = problems_of("trainer.spike.policy=often", "trainer.spike.metric=lr")
    assert "trainer.spike.policy='often' is not one of off, log, skip, rollback" in text
    assert "trainer.spike.metric='lr' is not one of loss, grad_norm" in text
    assert "trainer.spike.policy=skip cannot skip under backend.name=deepspeed: it applies the update in the same " \
           "call that computes the grad norm; use policy=rollback or log" in problems_of("trainer.spike.policy=skip",
                                                                                        "backend=zero2")


def test_good_spike_settings_validate():
    validate(compose_config(["recipe=sft_tiny", "trainer.spike.policy=rollback"]), 1)  # the recipe saves every 250
    validate(compose_config(["recipe=sft_tiny", "trainer.spike.policy=rollback", "backend=zero2"]), 1)


def test_bad_batch_fault_corrupts_one_rank_once(monkeypatch):
    assert _parse_fault("rank=1,step=7,kind=bad_batch") == {"kind": "bad_batch", "rank": 1, "step": 7}
    with pytest.raises(ValueError, match="kind=bad_batch"):
        _parse_fault("rank=1,step=7,kind=bad_batch,signal=KILL")
    monkeypatch.setenv("LLMTRAIN_TEST_FAULT", "rank=1,step=7,kind=bad_batch")
    labels = torch.tensor([[-100, -100, 5, 6], [-100, 7, 8, -100]])  # (B, T)
    batch = Batch(input_ids=torch.tensor([[1, 2, 5, 6], [3, 7, 8, 0]]), labels=labels, attention_mask=None,
                  num_targets=3)
    assert corrupt_batches([batch], rank=0, step=7)[0] is batch and corrupt_batches([batch], rank=1, step=6)[0] is batch
    bad = corrupt_batches([batch], rank=1, step=7)[0]
    assert torch.equal(bad.labels, torch.zeros(2, 4, dtype=torch.long)) and bad.num_targets == 6  # 2 rows × 3 shifts
    assert corrupt_batches([batch], rank=1, step=7)[0] is batch  # a rollback replays step 7 on clean data


def test_window_examples_follow_the_sampler():
    """Epoch e visits randperm(N) seeded with seed + e in windows of the global batch (data/sampler.py)."""
    def perm(epoch: int) -> torch.Tensor:
        return torch.randperm(40, generator=torch.Generator().manual_seed(7 + epoch))

    windows = window_examples(list(range(40)), global_batch=8, seed=7, group_by_length=False)
    assert windows(1, 3) == [perm(0)[8:16].tolist(), perm(0)[16:24].tolist()]
    assert windows(5, 6) == [perm(1)[:8].tolist()]  # 5 windows per epoch: position 5 opens epoch 1


def fake_trainer(tmp_path: Path, monitor: SpikeMonitor, with_checkpoint: bool):
    checkpoints = tmp_path / "checkpoints"
    if with_checkpoint:
        (checkpoints / "step_4").mkdir(parents=True)
        (checkpoints / "step_4" / "COMPLETE").write_text("step 4\n")
    waited = []
    checkpointer = SimpleNamespace(dir=checkpoints, finalize_pending=lambda: waited.append(True))
    return SimpleNamespace(spikes=monitor, s=SimpleNamespace(spike=monitor.rule), step=7, checkpointer=checkpointer,
                           resumed_from=None, waited=waited)


def test_rollback_limits(tmp_path):
    rule = SpikeRule(policy="rollback", max_rollbacks=2)
    monitor = SpikeMonitor(rule, CPU)
    early = fake_trainer(tmp_path / "early", monitor, with_checkpoint=False)
    roll_back(early)  # no checkpoint yet: the discarded step stays skipped
    assert early.waited == [True] and monitor.spike_skipped_steps == 1 and monitor.rollbacks == 0
    monitor.rollbacks = 2
    with pytest.raises(SpikeError, match=r"step 7: a loss spike after trainer.spike.max_rollbacks=2 rollbacks.*"
                                         r"skipped_data.jsonl"):
        roll_back(fake_trainer(tmp_path / "late", monitor, with_checkpoint=True))
