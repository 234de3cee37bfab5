"""Where metrics go: metrics.jsonl (always), the console (rich, rank 0), W&B (when enabled).

Only rank 0 holds sinks. A sink gets one dict per optimizer step and one per evaluation.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line. On resume, the rows past the resumed step (steps the restart replays) are dropped
    first, so every step appears once; a torn line (the process killed mid-write) is dropped with a warning."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line, record in _parsed_lines(path) if record.get("step", 0) <= resume_step]
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)  # a kill while rewriting leaves the old file, never half of it
        self.file = open(path, "a")

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, allow_nan=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _parsed_lines(path: Path) -> list[tuple[str, dict]]:
    parsed = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            parsed.append((line, json.loads(line)))
        except json.JSONDecodeError:
            log.warning("%s line %d is not a whole JSON record (a write cut short): dropped", path, number)
    return parsed


class ConsoleSink:
    """A metrics line every `every` steps and after each evaluation; on a terminal, a rich progress bar too.

    Off a terminal (a log file, a SLURM job, a pipe) there is no live display: rich would redraw it from a
    background thread ten times a second into a file that keeps every frame.
    """

    def __init__(self, max_steps: int, start_step: int, every: int):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.every = every
        self.progress = self._progress_bar(max_steps, start_step) if self.console.is_terminal else None

    def _progress_bar(self, max_steps: int, start_step: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[status]}"), console=self.console, transient=False)
        self.task = progress.add_task("train", total=max_steps, completed=start_step, status="")
        progress.start()
        return progress

    def log(self, record: dict[str, Any]) -> None:
        if "eval_loss" in record:
            self.console.print(f"eval  {_format(record)}", soft_wrap=True)
            return
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"],
                                 status=f"loss {record['loss']:.4f} lr {record['lr']:.2e}")
        if self.every and (record["step"] % self.every == 0 or record["step"] == 1):
            self.console.print(f"train {_format(record)}", soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _format(record: dict[str, Any]) -> str:
    parts = []
    for key, value in record.items():
        if key.startswith(("memory_", "time_r")):  # per-rank ledgers: in metrics.jsonl, too long for a console line
            continue
        if isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) else str(value)
        parts.append(f"{key}={value}")
    return " ".join(parts)


# W&B's names for the flat metrics.jsonl keys: exact names first, then the first pattern that matches; a key none
# of them claims is in the stage's own group (its spec's `metric_group`: reward/, dpo/, ppo/; pretrain and SFT: train/).
WANDB_EXACT = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
               "skipped_steps": "train/skipped_steps", "tokens": "train/tokens", "pairs": "train/pairs",
               "samples": "train/samples", "step_time_s": "perf/step_time_s",
               "plan_step_time_s": "perf/plan_step_time_s", "mfu": "perf/mfu", "hfu": "perf/hfu"}
WANDB_PATTERNS = tuple((re.compile(pattern), name) for pattern, name in (
    (r"^eval_(.+)", r"eval/\1"),
    (r"^plan_memory_(.+)", r"memory/plan_\1"),
    (r"^memory_(.+)", r"memory/\1"),
    (r"^([a-z]+)_memory_(.+)", r"memory/\1_\2"),  # another trainable role's model states: critic_memory_r0_grads
    (r"^plan_comm_(.+)", r"comm/plan_\1"),
    (r"^comm_(.+)", r"comm/\1"),
    (r"^(.+_per_s)$", r"perf/\1"),
    # where the step time went (metrics/timing.py, metrics/straggler.py): time/data_s, time/r1_busy_s, ...
    (r"^time_((?:data|compute|optim|comm|ckpt|eval|other)_s|r\d+_.+)$", r"time/\1"),
    (r"^(straggler_.+)$", r"time/\1"),
    (r"^(spikes?|spike_.+)$", r"train/\1"),  # loss spikes (llmtrain/spikes.py), whatever the stage
))
WANDB_GROUPS = ("train/", "eval/", "perf/", "memory/", "comm/", "time/")
WANDB_STEP = "train/step"  # every row carries it; every group is plotted against it (define_metric)


def wandb_key(key: str, group: str) -> str:
    """The W&B name of one metrics.jsonl key (`eval_loss` -> `eval/loss`, `kl` in PPO -> `ppo/kl`)."""
    if key in WANDB_EXACT:
        return WANDB_EXACT[key]
    for pattern, name in WANDB_PATTERNS:
        if pattern.match(key):
            return pattern.sub(name, key)
    return f"{group}/{key}"


REDACTED = "<redacted>"
_SECRET_KEY = re.compile(r"^token$|(^|_)((access|auth|hub|hf|api|wandb|github|gh)_?token|secret|password|passwd|"
                         r"api_?key|apikey|credentials?|private_?key)$", re.I)  # not pad_token, max_new_tokens
_SECRET_VALUE = re.compile(r"(\bhf_[A-Za-z0-9]{8,}|\bsk-[A-Za-z0-9_-]{8,}|\bgh[pousr]_[A-Za-z0-9]{8,}|"
                           r"\b[0-9a-f]{40}\b|://[^/@\s]+:[^/@\s]+@|\bbearer\s+\S+)", re.I)


def redact(value: Any, key: str = "") -> Any:
    """A copy of a config with secret-looking entries replaced: keys named like credentials (api_key, hub_token,
    password, ...) and string values shaped like one (hf_..., sk-..., gh*_..., a 40-hex W&B key, user:pass@ in
    a URL, "Bearer ..."). The git SHA (40 hex under `git_sha`) is kept."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, key) for v in value]
    if value is not None and _SECRET_KEY.search(key):
        return REDACTED
    if isinstance(value, str) and key != "git_sha" and _SECRET_VALUE.search(value):
        return REDACTED
    return value


class WandbSink:
    """The same records in W&B under grouped names (`wandb_key`), plotted against the train step.

    The run id lives in `state_file` (the run dir's wandb.json) with the last step W&B was sent: a resumed run
    continues that W&B run (`resume="allow"`) and sends nothing at or below that step again, so the steps a
    restart replays never reach W&B twice and W&B never sees a step go backwards. The config is `redact`ed."""

    def __init__(self, *, project: str, name: str | None, directory: Path, mode: str | None, entity: str | None,
                 tags: list[str], config: dict, group: str, state_file: Path, resumed: bool):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        saved = json.loads(state_file.read_text()) if resumed and state_file.exists() else {}
        self.state_file, self.group = state_file, group
        self.sent_up_to = saved.get("last_step", -1)  # the previous process's last step: replays stop here
        self.last_step = self.sent_up_to
        self.run = wandb.init(project=project, name=name, dir=str(directory), mode=mode, entity=entity,
                              tags=redact(tags) or None, config=redact(config), id=saved.get("id"), resume="allow",
                              # W&B's own metadata holds the command line (a secret may be in it): ours is the config
                              settings=wandb.Settings(x_disable_meta=True, disable_code=True, disable_git=True))
        self.run_id_ = self.run.id
        self.run.define_metric(WANDB_STEP)
        for prefix in {*WANDB_GROUPS, f"{group}/"}:
            self.run.define_metric(f"{prefix}*", step_metric=WANDB_STEP)
        self._save_state()

    @property
    def run_id(self) -> str:
        return self.run_id_

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step <= self.sent_up_to:  # a replayed step: W&B has it already
            return
        row = {wandb_key(k, self.group): v for k, v in record.items() if k != "step"}
        self.run.log({WANDB_STEP: step, **row}, step=step)
        if step > self.last_step:
            self.last_step = step
            self._save_state()

    def _save_state(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self.run_id_, "last_step": self.last_step}) + "\n")
        tmp.replace(self.state_file)

    def close(self) -> None:
        self.run.finish()
