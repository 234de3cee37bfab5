"""`python -m llmtrain.doctor RUN_DIR`: where a run's step time went, and which cause dominates, with its figures.

Reads RUN_DIR/metrics.jsonl: each train row's `step_time_s` and its parts `time_<phase>_s` (metrics/timing.py;
rank 0's), the straggler windows' per-rank means (`time_r<rank>_busy_s`, ... : metrics/straggler.py) and the
planner's `plan_step_time_s` where the run recorded one; RUN_DIR/config.yaml for the straggler threshold when there.
Every finding carries the seconds it cost over the logged steps; the costliest is the dominant cause. Step 1 warms up
(lazy optimizer state, the allocator, compilation): it counts in the table, never as a jump nor in a fit.

- periodic: a phase that jumps every k steps (a checkpoint save, an evaluation, a loader stall at an epoch switch):
  the jumps' excess over the phase's median. A save or an evaluation runs after a step's row, so it is in the next
  row: "after steps k, 2k, ...". A single jump is "once"; jumps at no regular period count as jitter.
- steady: data wait, exposed communication or other time that every step pays: its median × the steps (the
  communication a slow rank explains is that rank's, below).
- jitter: data or communication time that varies from step to step (std/mean > 0.5): the time above its median.
- decay: step time that grows over the run (the fitted line's rise > 20 %): the time above the first step's fit.
- slow rank: a rank busier than the median rank (busy: step time less exposed communication); the others wait
  its excess in a collective every step.
- plan: the median step time above the planner's prediction (> 1.25×).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

PHASES = ("data", "compute", "optim", "comm", "ckpt", "eval", "other")  # metrics/timing.py's (no torch import here)
NAMES = {"step": "step time (in no one part)", "data": "data loader wait",
         "compute": "compute", "optim": "optimizer", "comm": "exposed communication",
         "ckpt": "checkpoint save", "eval": "evaluation", "other": "other time"}
AFTER_ROW = ("ckpt", "eval")  # run after a step's row: their time is in the next row
STEADY = ("data", "comm", "other")  # overheads every step may pay; compute and optimizer are the work itself
JITTERY = ("data", "comm")
SPIKE_SHARE = 0.1  # a jump: above the phase's median by more than this share of the median step (and 5 MADs)
STEADY_SHARE = 0.1  # a steady overhead worth naming: this share of the median step
JITTER_CV = 0.5
DECAY_RISE = 0.2
PLAN_RATIO = 1.25
DEFAULT_THRESHOLD = 0.2  # trainer.straggler_threshold's default
_RANK_KEY = re.compile(r"^time_r(\d+)_busy_s$")


@dataclass
class Finding:
    kind: str  # periodic | once | steady | jitter | decay | slow_rank | plan
    cause: str  # a phase name, "rank <r>", "step time"
    lost_s: float  # seconds it cost over the logged steps
    text: str
    figures: dict = field(default_factory=dict)


@dataclass
class Diagnosis:
    steps: int
    step_time_s: float  # median
    total_s: float
    parts: dict  # phase -> {"mean_s", "share", "cv"}
    findings: list  # Finding, costliest first

    @property
    def dominant(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def headline(self) -> str:
        if self.dominant is None and not self.parts:
            return "no cause stands out in the step times (this run logged no time_<part>_s: an older llmtrain)"
        if self.dominant is None:
            work = sum(self.parts[p]["share"] for p in ("compute", "optim") if p in self.parts)
            return f"no cause stands out: compute and optimizer are {work:.0%} of the step time"
        return f"dominant: {self._line(self.dominant)}"

    def _line(self, finding: Finding) -> str:
        return f"{finding.text} ({finding.lost_s:.3g} s, {finding.lost_s / self.total_s:.0%} of the step time)"

    def text(self) -> str:
        lines = [f"{self.steps} steps, median step {self.step_time_s:.4g} s, {self.total_s:.4g} s in all",
                 f"{'part':<24}{'mean s':>10}{'share':>8}{'std/mean':>10}"]
        for phase, p in self.parts.items():
            lines.append(f"{NAMES[phase]:<24}{p['mean_s']:>10.4f}{p['share']:>8.1%}{p['cv']:>10.2f}")
        lines.append(self.headline())
        lines += [f"- [{f.kind}] {self._line(f)}" for f in self.findings]
        return "\n".join(lines)


def load_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics.jsonl in {run_dir} (a run folder: output_dir of a run)")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill (the sink drops it on resume too)
    return records


def train_rows(records: list[dict]) -> list[dict]:
    """Train rows (those with a step time), one per step (the last written: a resumed run rewrites replayed ones)."""
    rows = {r["step"]: r for r in records if "step_time_s" in r}
    return [rows[step] for step in sorted(rows)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _cv(values: list[float]) -> float:
    mean = _mean(values)
    return statistics.pstdev(values) / mean if len(values) > 1 and mean > 0 else 0.0


def jumps(values: list[float], floor: float) -> list[int]:
    """Indices of values above the median by more than `floor` and 5 scaled MADs (robust to the jumps themselves)."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    limit = median + max(floor, 5 * 1.4826 * mad)
    return [i for i, v in enumerate(values) if v > limit]


def period(steps: list[int]) -> int | None:
    """The spacing of `steps` when at least two thirds of the gaps between them share it (two gaps or more)."""
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    if len(gaps) < 2:
        return None
    gap, count = Counter(gaps).most_common(1)[0]
    return gap if count >= math.ceil(2 * len(gaps) / 3) else None


def _listed(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:4]))
    return shown + (", ..." if len(steps) > 4 else "")


def _periodic(rows: list[dict], phase: str, floor: float) -> tuple[Finding | None, set[int]]:
    """A phase's jumps ("step": the step time's, where no phase jumped) as one finding, and their row indices."""
    values = [r[f"time_{phase}_s"] if phase != "step" else r["step_time_s"] for r in rows]
    found = [i for i in jumps(values, floor) if rows[i]["step"] > 1]  # step 1 warms up: lazy state, allocator
    if not found:
        return None, set()
    median = statistics.median(values)
    excess = sum(values[i] - median for i in found)
    offset = 1 if phase in AFTER_ROW else 0
    steps = [rows[i]["step"] - offset for i in found]
    where = ("after " if offset else "at ") + ("steps " if len(steps) > 1 else "step ") + _listed(steps)
    each = excess / len(found)
    k = period(steps)
    figures = {"phase": phase, "steps": steps, "each_s": each, "period": k}
    if k is None and len(found) > 1:
        return None, set()  # jumps at no regular period: jitter, measured over every step below
    if k is None:
        return Finding("once", phase, excess, f"{NAMES[phase]} once, {where}: {each:.3g} s", figures), set(found)
    return Finding("periodic", phase, excess, f"{NAMES[phase]} every {k} steps ({where}): {each:.3g} s each",
                   figures), set(found)


def _slow_rank(records: list[dict], steps: int, threshold: float) -> Finding | None:
    windows = [r for r in records if any(_RANK_KEY.match(k) for k in r)]
    if not windows:
        return None
    ranks = sorted({int(m.group(1)) for r in windows for k in r if (m := _RANK_KEY.match(k))})
    if len(ranks) < 2:
        return None

    def mean(rank: int, part: str) -> float:
        return _mean([w.get(f"time_r{rank}_{part}_s", 0.0) for w in windows])

    busy = [mean(r, "busy") for r in ranks]
    median = statistics.median_low(busy)
    worst = max(range(len(ranks)), key=busy.__getitem__)
    excess = busy[worst] - median
    if not (excess > threshold * median and excess > 1e-3 and median > 0):
        return None
    rank, typical = ranks[worst], ranks[busy.index(median)]
    extra = {p: mean(rank, p) - mean(typical, p) for p in PHASES if p != "comm"}
    part = max(extra, key=extra.get)
    named = sum(1 for w in windows if w.get("straggler_rank") == rank)
    text = (f"rank {rank} is slow: busy {busy[worst]:.3g} s a step against the median rank's {median:.3g} s "
            f"(+{excess / median:.0%}), named in {named} of {len(windows)} windows; its excess is in {NAMES[part]}: "
            f"{mean(rank, part):.3g} s against rank {typical}'s {mean(typical, part):.3g} s, the other ranks wait "
            "for it in their collectives")
    return Finding("slow_rank", f"rank {rank}", excess * steps, text,
                   {"rank": rank, "busy_s": busy[worst], "median_s": median, "part": part, "named_windows": named,
                    "windows": len(windows)})


def _decay(rows: list[dict], keep: list[int]) -> Finding | None:
    if len(keep) < 10:
        return None
    steps = [rows[i]["step"] for i in keep]
    times = [rows[i]["step_time_s"] for i in keep]
    slope, intercept = statistics.linear_regression(steps, times)
    first, last = intercept + slope * steps[0], intercept + slope * steps[-1]
    if first <= 0 or (last - first) / first <= DECAY_RISE:
        return None
    lost = sum(intercept + slope * s - first for s in steps)
    return Finding("decay", "step time", lost,
                   f"step time grows from {first:.3g} s to {last:.3g} s over steps {steps[0]}-{steps[-1]} "
                   f"(+{(last - first) / first:.0%}, fitted)", {"first_s": first, "last_s": last})


def diagnose(records: list[dict], straggler_threshold: float = DEFAULT_THRESHOLD) -> Diagnosis:
    rows = train_rows(records)
    if not rows:
        raise ValueError("no train rows (with step_time_s) in metrics.jsonl: did the run take a step?")
    times = [r["step_time_s"] for r in rows]
    total, median_step = sum(times), statistics.median(times)
    phases = [p for p in PHASES if all(f"time_{p}_s" in r for r in rows)]  # runs before the split have none
    parts = {p: {"mean_s": _mean(v), "share": sum(v) / total if total else 0.0, "cv": _cv(v)}
             for p in phases for v in [[r[f"time_{p}_s"] for r in rows]]}
    findings, jumped = [], set()
    floor = SPIKE_SHARE * median_step
    for phase in phases:
        finding, found = _periodic(rows, phase, floor)
        if finding is not None:
            findings.append(finding)
            jumped |= found
    finding, found = _periodic(rows, "step", floor)  # slow steps no single part explains (old runs: all)
    if finding is not None and not found <= jumped:
        findings.append(finding)
        jumped |= found
    slow = _slow_rank(records, len(rows), straggler_threshold)
    if slow is not None:
        findings.append(slow)
    calm = [i for i in range(len(rows)) if i not in jumped and rows[i]["step"] > 1]
    for phase in (p for p in STEADY if p in phases):
        values = [rows[i][f"time_{phase}_s"] for i in calm]
        median = statistics.median(values) if values else 0.0
        lost = median * len(rows)
        if phase == "comm" and slow is not None:  # the waiting a slow rank causes is that rank's finding
            lost = max(0.0, lost - slow.lost_s)
        if median > STEADY_SHARE * median_step and lost > 0:
            findings.append(Finding("steady", phase, lost,
                                    f"{NAMES[phase]}: {median:.3g} s of each {median_step:.3g} s step "
                                    f"({median / median_step:.0%})", {"phase": phase, "median_s": median}))
        if phase in JITTERY and values and _cv(values) > JITTER_CV and _mean(values) > 0.05 * median_step:
            findings.append(Finding("jitter", phase, sum(max(0.0, v - median) for v in values),
                                    f"{NAMES[phase]} varies from step to step: std/mean {_cv(values):.2f} "
                                    f"(mean {_mean(values):.3g} s)", {"phase": phase, "cv": _cv(values)}))
    decay = _decay(rows, calm)
    if decay is not None:
        findings.append(decay)
    findings += _plan(records, rows, median_step)
    findings.sort(key=lambda f: f.lost_s, reverse=True)
    return Diagnosis(len(rows), median_step, total, parts, findings)


def _plan(records: list[dict], rows: list[dict], median_step: float) -> list[Finding]:
    planned = next((r["plan_step_time_s"] for r in records if r.get("plan_step_time_s")), None)
    if planned is None or median_step <= PLAN_RATIO * planned:
        return []
    return [Finding("plan", "step time", (median_step - planned) * len(rows),
                    f"the median step {median_step:.3g} s is {median_step / planned:.2f}× the planner's "
                    f"{planned:.3g} s", {"planned_s": planned, "ratio": median_step / planned})]


def _threshold(run_dir: Path) -> float:
    config = Path(run_dir) / "config.yaml"
    if config.exists():
        match = re.search(r"^\s+straggler_threshold:\s*([0-9.eE+-]+)\s*$", config.read_text(), re.M)
        if match:
            return float(match.group(1))
    return DEFAULT_THRESHOLD


def diagnose_run(run_dir: Path) -> Diagnosis:
    return diagnose(load_records(Path(run_dir)), _threshold(Path(run_dir)))


def summary_line(run_dir: Path) -> str:
    """The run's end summary: the headline, or why there is none."""
    try:
        return f"doctor: {diagnose_run(run_dir).headline()} (python -m llmtrain.doctor {run_dir})"
    except (OSError, ValueError) as error:
        return f"doctor: no diagnosis ({error})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's output_dir (holds metrics.jsonl)")
    parser.add_argument("--json", action="store_true", help="the findings as JSON")
    args = parser.parse_args(argv)
    try:
        diagnosis = diagnose_run(args.run_dir)
    except (OSError, ValueError) as error:
        print(f"doctor: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(diagnosis), "headline": diagnosis.headline()}, indent=1))
    else:
        print(diagnosis.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
