"""llmtrain.doctor on synthetic metrics.jsonl records: each cause alone, then together, with hand-computed figures."""

from __future__ import annotations

import json
import random

import pytest

from llmtrain import doctor
from llmtrain.doctor import diagnose, period
from llmtrain.metrics import timing

PARTS = {"data": 0.01, "compute": 0.2, "optim": 0.02, "comm": 0.01, "ckpt": 0.0, "eval": 0.0, "other": 0.01}


def row(step: int, **changes: float) -> dict:
    parts = {**PARTS, **changes}
    return {"step": step, "loss": 1.0, "step_time_s": sum(parts.values()),
            **{f"time_{p}_s": v for p, v in parts.items()}}


def healthy(steps: int = 40) -> list[dict]:
    return [row(s) for s in range(1, steps + 1)]


def test_the_doctor_knows_the_clock_phases():
    assert doctor.PHASES == timing.PHASES


def test_a_healthy_run_has_no_dominant_cause():
    d = diagnose(healthy())
    assert d.findings == [] and d.step_time_s == pytest.approx(0.25)
    assert d.headline() == "no cause stands out: compute and optimizer are 88% of the step time"
    assert d.parts["compute"]["share"] == pytest.approx(0.8) and d.parts["data"]["cv"] == pytest.approx(0.0)


def test_a_run_without_the_parts_still_gets_its_periodic_steps():
    """An older run (step_time_s only): slow steps every 10 are found on the step time itself."""
    rows = [{"step": s, "step_time_s": 1.5 if s % 10 == 0 else 0.5} for s in range(1, 41)]
    d = diagnose(rows)
    assert d.parts == {} and [(f.kind, f.cause, f.figures["period"]) for f in d.findings] == [("periodic", "step", 10)]
    assert diagnose(rows[:9]).headline().startswith("no cause stands out in the step times")


def test_a_slow_loader_is_named_with_its_share():
    d = diagnose([row(s, data=0.3) for s in range(1, 41)])
    top = d.dominant
    assert (top.kind, top.cause) == ("steady", "data")
    assert top.figures["median_s"] == pytest.approx(0.3) and top.lost_s == pytest.approx(40 * 0.3)
    assert "data loader wait: 0.3 s of each 0.54 s step (56%)" in d.headline()


def test_a_save_every_k_steps_is_named_with_its_period():
    """Saves after steps 5, 10, 15, 20 (in the rows of 6, 11, 16, 21), 0.5 s each."""
    d = diagnose([row(s, ckpt=0.5 if s in (6, 11, 16, 21) else 0.0) for s in range(1, 25)])
    top = d.dominant
    assert (top.kind, top.cause) == ("periodic", "ckpt")
    assert top.figures["period"] == 5 and top.figures["steps"] == [5, 10, 15, 20]
    assert top.figures["each_s"] == pytest.approx(0.5) and top.lost_s == pytest.approx(2.0)
    assert top.text == "checkpoint save every 5 steps (after steps 5, 10, 15, 20): 0.5 s each"


def test_an_epoch_switch_shows_as_periodic_data_stalls():
    d = diagnose([row(s, data=0.8 if s % 8 == 1 and s > 1 else 0.01) for s in range(1, 41)])
    top = d.dominant
    assert (top.kind, top.cause, top.figures["period"]) == ("periodic", "data", 8)
    assert top.figures["steps"] == [9, 17, 25, 33] and "at steps 9, 17, 25, 33" in top.text


def test_jitter_is_measured_as_std_over_mean():
    rng = random.Random(0)
    comm = [rng.choice([0.0, 0.0, 0.0, 0.2]) for _ in range(60)]
    d = diagnose([row(s + 1, comm=c) for s, c in enumerate(comm)])
    jitter = next(f for f in d.findings if f.kind == "jitter")
    after_warmup = comm[1:]  # step 1 warms up: left out
    mean = sum(after_warmup) / len(after_warmup)
    std = (sum((c - mean) ** 2 for c in after_warmup) / len(after_warmup)) ** 0.5
    assert jitter.cause == "comm" and jitter.figures["cv"] == pytest.approx(std / mean)


def test_gradual_decay_is_fitted():
    """compute grows linearly from 0.2 s to 0.4 s over 41 steps: the fit (from step 2: step 1 warms up) follows."""
    d = diagnose([row(s, compute=0.2 + 0.005 * (s - 1)) for s in range(1, 42)])
    decay = d.dominant
    assert decay.kind == "decay"
    assert decay.figures["first_s"] == pytest.approx(0.255) and decay.figures["last_s"] == pytest.approx(0.45)
    assert decay.lost_s == pytest.approx(sum(0.005 * i for i in range(40)))


def test_a_slow_rank_is_named_and_the_wait_it_causes_is_its_own():
    """Rank 1 sleeps 0.3 s in each step's `other`; rank 0 waits for it in a collective (comm)."""
    rows = [row(s, comm=0.31) for s in range(1, 21)]
    windows = [{"step": s, "straggler_rank": 1 if s >= 8 else -1,
                "time_r0_busy_s": 0.24, "time_r0_other_s": 0.01, "time_r0_data_s": 0.01,
                "time_r1_busy_s": 0.54, "time_r1_other_s": 0.31, "time_r1_data_s": 0.01} for s in range(4, 21, 4)]
    for w, r in zip(windows, rows[3::4]):
        r.update(w)
    d = diagnose(rows)
    top = d.dominant
    assert (top.kind, top.cause) == ("slow_rank", "rank 1")
    assert top.figures["part"] == "other" and top.figures["named_windows"] == 4 and top.figures["windows"] == 5
    assert top.lost_s == pytest.approx(0.3 * 20)
    steady_comm = [f for f in d.findings if f.kind == "steady" and f.cause == "comm"]
    assert steady_comm and steady_comm[0].lost_s == pytest.approx(0.31 * 20 - 0.3 * 20)  # what the rank leaves


def test_the_planner_prediction_is_compared():
    rows = healthy(10)
    rows[0]["plan_step_time_s"] = 0.1
    plan = next(f for f in diagnose(rows).findings if f.kind == "plan")
    assert plan.figures["ratio"] == pytest.approx(2.5) and plan.lost_s == pytest.approx(10 * 0.15)
    rows[0]["plan_step_time_s"] = 0.22
    assert not [f for f in diagnose(rows).findings if f.kind == "plan"]  # within 1.25×


def test_period_needs_a_regular_spacing():
    assert period([5, 10, 15, 20]) == 5
    assert period([5, 10, 15, 21]) == 5  # two gaps of three
    assert period([5, 10]) is None and period([3, 10, 12, 30]) is None


def test_the_command_line(tmp_path, capsys):
    rows = [row(s, ckpt=0.5 if s in (6, 11, 16) else 0.0) for s in range(1, 20)]
    rows.insert(3, {"step": 3, "eval_loss": 1.0})  # eval rows are skipped
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 20, "lo')
    assert doctor.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "19 steps" in out and "dominant: checkpoint save every 5 steps (after steps 5, 10, 15)" in out
    assert doctor.main([str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["findings"][0]["figures"]["period"] == 5 and report["headline"].startswith("dominant:")
    assert doctor.main([str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert doctor.summary_line(tmp_path).startswith("doctor: dominant: checkpoint save every 5 steps")
