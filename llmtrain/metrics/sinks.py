"""Where metrics go: metrics.jsonl (always), the console (rich, rank 0), W&B (when enabled).

Only rank 0 holds sinks. A sink gets one dict per optimizer step and one per evaluation.
"""

from __future__ import annotations

import json
import logging
import math
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
        if key.startswith("memory_"):  # per-rank byte ledgers: in metrics.jsonl, too long for a console line
            continue
        if isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) else str(value)
        parts.append(f"{key}={value}")
    return " ".join(parts)


class WandbSink:
    """Logs the same records to W&B; the config passed in must already be free of secrets."""

    def __init__(self, *, project: str, name: str | None, directory: Path, mode: str | None,
                 entity: str | None, tags: list[str], config: dict, resume_id: str | None = None):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=str(directory), mode=mode, entity=entity,
                              tags=tags or None, config=config, id=resume_id,
                              resume="allow" if resume_id else None)

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()
