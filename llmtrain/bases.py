"""Trained tiny base models without a model hub: `model.name_or_path: ${base:sft_tiny}`.

`${base:RECIPE}` (RECIPE: a name in recipes/ or a path to a .yaml) resolves to the Hugging Face export
(`hf/`) of that recipe's run, trained once into a cache and reused by every later run:

    $LLMTRAIN_CACHE (default ~/.cache/llmtrain)/bases/<recipe>-<key>/
        hf/  metrics.jsonl  config.yaml  build.log  base.json
    $LLMTRAIN_CACHE/bases/<recipe>-<key>.lock

The key hashes what determines the weights: the base recipe's composed and resolved config (as it is
built: device=cpu precision=fp32 logger=jsonl; output_dir left out), the contents of every file or
folder the config names (data, tokenizer, a base's own base), torch and transformers versions, and
CACHE_FORMAT. Changing any of them builds a new entry; deleting an entry rebuilds it.

The build runs `python -m llmtrain recipe=RECIPE ...` in a subprocess whose environment has no launcher
variables, so under torchrun it trains as a world of one. It writes into a temp folder beside the entry
and renames it into place: an entry either is complete or does not exist. Every process takes the
entry's file lock first; the first builds, the others wait and then reuse (under torchrun all ranks
compose their config before the process group starts, so waiting there is safe).

`dry_run=true` of a recipe with a base builds the base too: validation reads the model's config.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llmtrain.config import ConfigError
from llmtrain.paths import available_recipes, recipes_dir

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when a code change alters what a build produces: every entry is rebuilt
BUILD_OVERRIDES = ("device=cpu", "precision=fp32", "logger=jsonl")
# What torchrun (and the deepspeed launcher) put in a worker's environment; none may reach a build.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")
LAUNCHER_ENV_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
LOG_TAIL_LINES = 30

_resolving: list[Path] = []  # recipe files whose base is being resolved in this process: cycle detection


class BaseBuildError(ConfigError):
    """A base recipe's training run failed; the message names the recipe and ends with its log's tail."""


@dataclass(frozen=True)
class BaseEntry:
    ref: str  # as the recipe named it: sft_tiny or /abs/path.yaml
    name: str  # the recipe's stem
    key: str
    bases_dir: Path

    @property
    def dir(self) -> Path:
        return self.bases_dir / f"{self.name}-{self.key}"

    @property
    def hf(self) -> Path:
        return self.dir / "hf"

    @property
    def lock(self) -> Path:
        return self.bases_dir / f"{self.name}-{self.key}.lock"

    def is_complete(self) -> bool:
        return (self.dir / "base.json").is_file() and (self.hf / "config.json").is_file()


def cache_root() -> Path:
    return Path(os.environ.get("LLMTRAIN_CACHE") or Path.home() / ".cache" / "llmtrain").expanduser().resolve()


def recipe_file(ref: str) -> Path:
    """The yaml a base reference names: a recipe name in recipes/ or a path to a .yaml/.yml file."""
    if ref in available_recipes():
        return (recipes_dir() / f"{ref}.yaml").resolve()
    path = Path(ref).expanduser()
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve()
    raise ConfigError(f"${{base:{ref}}}: no such recipe; name one of {', '.join(available_recipes())} "
                      "or give the path of a recipe .yaml")


def _build_ref(ref: str) -> str:
    """What the build's `recipe=` gets: the name of a shipped recipe, else the yaml's absolute path."""
    return ref if ref in available_recipes() else str(recipe_file(ref))


def content_hash(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names and contents, in sorted order)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if file != path:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


MODEL_DIR_MARKERS = ("config.json", "tokenizer.json", "tokenizer_config.json")


def _canonical(node):
    """The config with every file, and every model or tokenizer folder, replaced by its name and content
    hash: the key follows what they hold, not where the checkout or the cache lives. Other folders (a W&B
    dir, /tmp) stay strings: hashing them would read anything."""
    if isinstance(node, dict):
        return {k: _canonical(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    if isinstance(node, str) and "/" in node:
        path = Path(node).expanduser()
        if path.is_file() or (path.is_dir() and any((path / m).is_file() for m in MODEL_DIR_MARKERS)):
            return {"path": path.name, "sha256": content_hash(path)}
    return node


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def base_entry(ref: str, compose_config) -> BaseEntry:
    """Compose the base recipe as it will be built (`compose_config`: llmtrain.compose's, nested: it resolves the
    base's own bases) and hash it."""
    from omegaconf import OmegaConf

    path = recipe_file(ref)
    cfg = OmegaConf.to_container(compose_config([f"recipe={_build_ref(ref)}", *BUILD_OVERRIDES]), resolve=True)
    for unrelated in ("output_dir", "logger"):  # where the run writes and what it logs to
        cfg.pop(unrelated)
    what = {"config": _canonical(cfg), "versions": versions(), "format": CACHE_FORMAT}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    return BaseEntry(ref=ref, name=path.stem, key=key, bases_dir=cache_root() / "bases")


def resolve_base(ref: str, compose_config) -> str:
    """`${base:REF}`: the path of REF's hf/ export, built once into the cache when it is missing."""
    path = recipe_file(ref)
    if path in _resolving:
        chain = " -> ".join(p.stem for p in [*_resolving[_resolving.index(path):], path])
        raise ConfigError(f"${{base:{ref}}}: base recipes form a cycle: {chain}")
    _resolving.append(path)
    try:
        entry = base_entry(ref, compose_config)
        with _locked(entry):
            if entry.is_complete():
                _log_rank0("reusing base model %s from %s", entry.name, entry.dir)
            else:
                build(entry)
        return str(entry.hf)
    finally:
        _resolving.pop()


@contextmanager
def _locked(entry: BaseEntry):
    """Hold the entry's file lock; rank 0 says so when it has to wait for another process's build."""
    from filelock import FileLock, Timeout

    entry.bases_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(entry.lock))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _log_rank0("waiting for another process to build base model %s into %s", entry.name, entry.dir)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _log_rank0(message: str, *args) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        log.info(message, *args)


def build(entry: BaseEntry) -> None:
    """Train the base recipe in a subprocess; rename the finished entry into place (call with the lock)."""
    for stale in entry.bases_dir.glob(f".tmp-{entry.dir.name}-*"):  # a killed build's; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    if entry.dir.exists():  # no base.json: not made by build(); rebuild it
        shutil.rmtree(entry.dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.dir.name}-", dir=entry.bases_dir))
    try:
        log.info("building base model %s once into %s; later runs reuse it (log: %s)", entry.name, entry.dir,
                 tmp / "build.log")
        start = time.time()
        run_dir = _train(entry, tmp)
        staged = tmp / "entry"
        staged.mkdir()
        for name in ("hf", "metrics.jsonl", "config.yaml"):
            if (run_dir / name).exists():
                os.rename(run_dir / name, staged / name)
        os.rename(tmp / "build.log", staged / "build.log")
        record = {"recipe": entry.ref, "name": entry.name, "key": entry.key, "versions": versions(),
                  "build_seconds": round(time.time() - start, 1), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  **final_metrics(staged / "metrics.jsonl")}
        (staged / "base.json").write_text(json.dumps(record, indent=2) + "\n")
        os.rename(staged, entry.dir)  # atomic: the entry appears complete or not at all
        log.info("built base model %s in %.0f s: %s", entry.name, time.time() - start, entry.hf)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _train(entry: BaseEntry, tmp: Path) -> Path:
    run_dir = tmp / "run"
    command = [sys.executable, "-m", "llmtrain", f"recipe={_build_ref(entry.ref)}",
               *BUILD_OVERRIDES, f"output_dir={run_dir}"]
    with open(tmp / "build.log", "w") as out:
        result = subprocess.run(command, env=build_env(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    if result.returncode != 0 or not (run_dir / "hf" / "config.json").is_file():
        tail = "\n".join((tmp / "build.log").read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        raise BaseBuildError(f"base model {entry.name} (${{base:{entry.ref}}}) failed to build: "
                             f"`{' '.join(command[1:])}` exited with {result.returncode}; nothing was cached. "
                             f"Last lines of its log:\n{tail}")
    return run_dir


def build_env() -> dict:
    """This process's environment without launcher variables (a world of one), importing this llmtrain."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_ENV and not k.startswith(LAUNCHER_ENV_PREFIXES)}
    package_parent = str(Path(__file__).resolve().parent.parent)
    paths = [package_parent, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_parent]]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def final_metrics(metrics: Path) -> dict:
    """The last training loss and the last evaluation of a run's metrics.jsonl."""
    if not metrics.is_file():
        return {}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    out = {}
    if train:
        out.update(steps=train[-1]["step"], final_train_loss=train[-1]["loss"])
    if evals:
        out.update(eval_step=evals[-1]["step"], eval_loss=evals[-1]["eval_loss"],
                   eval_accuracy=evals[-1].get("eval_accuracy"))
    return out
