"""Where a step's time goes (metrics/timing.py), the slow rank's verdict (metrics/straggler.py) and the delay faults
(faults.py), on a clock the test moves by hand: every figure is a hand sum."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from llmtrain.faults import TEST_FAULT_ENV, _delay, inject
from llmtrain.metrics.comm import CommCounter
from llmtrain.metrics.sinks import wandb_key
from llmtrain.metrics.straggler import StragglerWatch, slow_rank, straggler_problems
from llmtrain.metrics.timing import PHASES, CommTimer, StepClock, busy


class HandClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def to(self, t: float) -> None:
        self.t = t


def test_phases_split_the_window_exactly():
    """data 0-1; compute 1-5 holding a collective 1.5-2 and the optimizer 3-4 (a collective 3.5-3.75 inside); other
    5-5.5; a save 5.5-7 whose barrier (6-6.5) stays the save's; other 7-7.5; the lap at 7.5."""
    t = HandClock()
    clock = StepClock(now=t)
    clock.start()
    with clock.phase("data"):
        t.to(1.0)
    with clock.phase("compute"):
        t.to(1.5)
        with clock.comm():
            t.to(2.0)
        t.to(3.0)
        clock.enter("optim")
        t.to(3.5)
        with clock.comm():
            t.to(3.75)
        t.to(4.0)
        clock.leave()
        t.to(5.0)
    t.to(5.5)
    with clock.phase("ckpt"):
        t.to(6.0)
        with clock.comm():
            t.to(6.5)
        t.to(7.0)
    t.to(7.5)
    times = clock.lap()
    assert times == {"step_time_s": 7.5, "time_data_s": 1.0, "time_compute_s": 2.5, "time_optim_s": 0.75,
                     "time_comm_s": 0.75, "time_ckpt_s": 1.5, "time_eval_s": 0.0, "time_other_s": 1.0}
    assert sum(times[f"time_{p}_s"] for p in PHASES) == times["step_time_s"]
    assert busy(times) == 6.75
    t.to(8.0)  # the next window starts at the lap
    assert clock.lap() == {"step_time_s": 0.5, **{f"time_{p}_s": 0.5 * (p == "other") for p in PHASES}}


def test_an_exception_closes_the_phases_it_left_open():
    """Updater.update leaves `optim` open when it raises (a non-finite step): the phase around it closes both."""
    t = HandClock()
    clock = StepClock(now=t)
    clock.start()
    with pytest.raises(RuntimeError), clock.phase("compute"):
        t.to(1.0)
        clock.enter("optim")
        t.to(3.0)
        raise RuntimeError("non-finite")
    t.to(4.0)
    expected = {"compute": 1.0, "optim": 2.0, "other": 1.0}
    assert clock.lap() == {"step_time_s": 4.0, **{f"time_{p}_s": expected.get(p, 0.0) for p in PHASES}}


def test_nothing_counts_before_start_nor_from_another_thread():
    t = HandClock()
    clock = StepClock(now=t)
    with clock.phase("eval"):  # the step-0 evaluation, before the loop
        t.to(2.0)
    clock.start()

    def background_save():  # a background writer's collectives are not the step's
        with clock.comm():
            pass

    with clock.phase("compute"):
        worker = threading.Thread(target=background_save)
        worker.start()
        worker.join()
        t.to(3.0)
    times = clock.lap()
    assert times["step_time_s"] == 1.0 and times["time_compute_s"] == 1.0 and times["time_comm_s"] == 0.0


def test_comm_timer_wraps_and_restores_the_collectives_and_counting_still_sees_them(tmp_path):
    """A real one-process gloo group: inside timing() every all_reduce is `comm`; CommCounter opened inside it (the
    first steps' live cost) still counts each call once; after both, torch's own functions are back."""
    originals = {m: m.all_reduce for m in (dist, c10d)}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        import torch

        clock = StepClock()
        with CommTimer(clock).timing():
            assert dist.all_reduce is not originals[dist] and c10d.all_reduce is not originals[c10d]
            clock.start()
            counter = CommCounter()
            with counter.counting(), clock.phase("compute"):
                dist.all_reduce(torch.ones(4))
                c10d.all_reduce(torch.ones(4))
            times = clock.lap()
        assert counter.calls["all_reduce"] == 2
        assert times["time_comm_s"] > 0 and sum(times[f"time_{p}_s"] for p in PHASES) == pytest.approx(
            times["step_time_s"], rel=1e-12)
        assert dist.all_reduce is originals[dist] and c10d.all_reduce is originals[c10d]
    finally:
        dist.destroy_process_group()


def test_slow_rank_against_the_lower_median():
    assert slow_rank([0.30, 0.50], 0.2) == 1  # 2 ranks: the faster is the median
    assert slow_rank([0.30, 0.34], 0.2) is None  # +13 %
    assert slow_rank([1.0, 1.0, 1.3, 1.0], 0.2) == 2
    assert slow_rank([0.0001, 0.0009], 0.2) is None  # under a millisecond: noise


def test_a_rank_is_named_after_the_windows_in_a_row():
    watch = StragglerWatch(every=2, threshold=0.2, windows=2, ctx=SimpleNamespace(world_size=2))
    verdicts = [watch.decide(b) for b in ([1, 2], [1, 1], [1, 2], [1, 2], [1, 2], [2, 1], [2, 1])]
    assert verdicts == [None, None, None, 1, 1, None, 0]


def test_straggler_fields_are_checked():
    good = SimpleNamespace(straggler_threshold=0.2, straggler_windows=3)
    assert straggler_problems(good) == []
    problems = straggler_problems(SimpleNamespace(straggler_threshold=0.0, straggler_windows=0))
    assert len(problems) == 2 and "trainer.straggler_threshold=0.0" in problems[0]
    assert "trainer.straggler_windows=0" in problems[1]


def test_delay_faults_match_their_point_rank_and_steps(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    text = "sleep=0.3,at=data;sleep=0.2,at=step,rank=1,every=2;rank=1,step=7,signal=KILL"
    assert _delay(text, "data", rank=0, step=3) == "rank=1,step=7,signal=KILL"
    assert slept == [0.3]
    _delay(text, "step", rank=0, step=2)
    _delay(text, "step", rank=1, step=3)
    assert slept == [0.3]
    _delay(text, "step", rank=1, step=4)
    assert slept == [0.3, 0.2]
    with pytest.raises(ValueError, match="sleep=SECONDS,at=data"):
        _delay("sleep=1,at=forward", "data", rank=0, step=1)
    monkeypatch.setenv(TEST_FAULT_ENV, "sleep=0.5,at=save,step=4")
    inject("save", rank=0, step=4)  # only a delay: no signal fault to parse
    assert slept == [0.3, 0.2, 0.5]


def test_time_keys_are_grouped_for_wandb():
    assert wandb_key("time_data_s", "train") == "time/data_s"
    assert wandb_key("time_other_s", "dpo") == "time/other_s"
    assert wandb_key("time_r3_busy_s", "train") == "time/r3_busy_s"
    assert wandb_key("straggler_rank", "train") == "time/straggler_rank"
    assert wandb_key("plan_step_time_s", "train") == "perf/plan_step_time_s"
    assert wandb_key("time_rollout_s", "ppo") == "ppo/time_rollout_s"  # PPO's own split of compute stays its own


def test_the_planner_step_time_reaches_step_one_of_the_live_cost():
    """plan.gpu with a known peak: the plan's step time (its row's `step_s`) is logged once, on step 1, as
    `plan_step_time_s` (what llmtrain.doctor compares with); without a peak there is no prediction and no key."""
    import torch

    from llmtrain.compose import compose_config
    from llmtrain.metrics.live import LiveCost
    from llmtrain.plan.report import plan_run

    plans = {gpu: plan_run(compose_config(["recipe=sft_tiny", *gpu]), 1, torch.device("cpu"), "fp32")
             for gpu in ((), ("plan.gpu=h100-80gb",))}
    assert plans[()].figures.step_s is None
    gpu_plan = plans[("plan.gpu=h100-80gb",)]
    assert gpu_plan.figures.step_s == gpu_plan.row.times["step_s"] > 0
    ctx = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))
    live = LiveCost(modules=[torch.nn.Linear(2, 2)], plan=gpu_plan.figures, ctx=ctx, steps=2)
    records = []
    for step in (1, 2):
        with live.step(step):
            pass
        records.append(live.record(step, 0.5))
    assert records[0]["plan_step_time_s"] == gpu_plan.figures.step_s and "plan_step_time_s" not in records[1]
