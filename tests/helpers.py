"""Plain helpers shared by every test folder and by the workers (tests/*/workers/): the repo's paths, a saved tiny
model folder, the tiny Llama's config and model, CLI runners, metrics readers, assertions on a run's exit, and the
recipe files of the ${base:...} tests. Fixtures live in the conftest.py files; this module holds no fixture and no
test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "llmtrain" / "assets" / "tokenizer"
PYTHON = sys.executable


def save_tiny_model(directory: Path, model_type: str = "llama", seed: int = 0, heads: int = 4) -> Path:
    """A random tiny model + the shipped tokenizer, saved with save_pretrained (loaded by from_pretrained); `heads`
    attention heads over h = 64 (half as many kv heads)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=256)
    if model_type == "gpt2":
        sizes = dict(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=256)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# The tiny Llama of the unit tests (and save_tiny_model's sizes): 263 = the shipped tokenizer's vocabulary. A test
# names what it changes (`tiny_llama_config(hidden_size=32, max_position_embeddings=64)`); fields not named here keep
# transformers' defaults (max_position_embeddings 2048).
TINY_LLAMA = dict(vocab_size=263, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def tiny_llama_config(**overrides):
    """A LlamaConfig of TINY_LLAMA's sizes, OVERRIDES on top (any LlamaConfig field)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_llama(seed: int | None = 0, attn_implementation: str | None = None, **overrides):
    """A randomly initialised causal LM of tiny_llama_config(**OVERRIDES), after torch.manual_seed(SEED) (None: the
    global generator as it is), by AutoModelForCausalLM.from_config (the same weights as LlamaForCausalLM(config))."""
    import torch
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    attention = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return AutoModelForCausalLM.from_config(tiny_llama_config(**overrides), **attention)


def cli_env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    env.update(extra)
    return env


def run_cli(args: list[str], *, nproc: int = 1, env: dict | None = None, timeout: int = 600,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m llmtrain ARGS` (nproc=1, no launcher: forked from tests/forkserver.py's server where the
    environment allows, else cold) or `torchrun --nproc_per_node N -m llmtrain ARGS` (always cold)."""
    env = env or cli_env()
    if nproc == 1:
        from tests.forkserver import CLIENT

        forked = CLIENT.run(["llmtrain", *args], env=env, cwd=cwd or REPO, timeout=timeout)
        if forked is not None:
            return forked
        cmd = [PYTHON, "-m", "llmtrain", *args]
    else:
        cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               "-m", "llmtrain", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or REPO)


def run_cli_jobs(jobs: dict[str, dict], parallel: int = 2) -> dict[str, subprocess.CompletedProcess]:
    """{name: run_cli's keyword arguments (args=..., env=..., timeout=...)} run PARALLEL at a time: one-process runs
    use one CPU core each (OMP_NUM_THREADS=1), so two of them share this 2-core machine without slowing each other
    much. -> {name: result}, each with its wall clock in `result.seconds`."""
    from concurrent.futures import ThreadPoolExecutor
    from time import perf_counter

    def timed(job: dict) -> subprocess.CompletedProcess:
        start = perf_counter()
        result = run_cli(**job)
        result.seconds = perf_counter() - start  # wall clock of the CLI process
        return result

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {name: pool.submit(timed, job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def run_recipes(tmp_path_factory, recipes: list[str], *extra: str) -> dict[str, Path]:
    """`python -m llmtrain recipe=RECIPE` as a user runs it, for each of RECIPES, each into a fresh folder (one run
    serves a module), two at a time: {recipe: its run folder}."""
    outs = {recipe: tmp_path_factory.mktemp(recipe) for recipe in recipes}
    results = run_cli_jobs({recipe: {"args": [f"recipe={recipe}", *extra, f"output_dir={out}"], "timeout": 1200}
                            for recipe, out in outs.items()})
    for result in results.values():
        assert_ok(result)
    return outs


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in records if "loss" in r], [r for r in records if any(k.startswith("eval_") for k in r)]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def worker_exit_codes(stderr: str) -> list[int]:
    """The workers' exit codes in torchrun's failure report (the first to exit, and any it saw fail before it
    stopped the others; a worker torchrun stopped shows -15)."""
    import re

    return [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)]


def ranks_refused(result: subprocess.CompletedProcess, nproc: int) -> list[int]:
    """The ranks that printed `llmtrain: error on rank R` for a launch refused before the model loads; the others
    must have been stopped by torchrun (a rank still importing when the first one exited: torchrun sends SIGTERM
    to the rest), so every rank either refused or never got as far as loading. Which rank reports first is a race
    (CI saw rank 2 of 3 refuse while ranks 0 and 1 were still importing), so any one of them may be the reporter."""
    import re

    reported = [rank for rank in range(nproc) if f"llmtrain: error on rank {rank}" in result.stderr]
    stopped = len(re.findall(r"Sending process \d+ closing signal SIGTERM", result.stderr))
    assert result.returncode != 0 and reported, result.stderr[-3000:]
    assert len(reported) + stopped >= nproc, (reported, stopped, result.stderr[-3000:])
    assert "Loading weights" not in result.stderr + result.stdout, result.stderr[-3000:]
    return reported


def assert_stopped_nonfinite(result: subprocess.CompletedProcess, *, nproc: int, step: int) -> None:
    """A run stopped by the non-finite rule: every rank printed the message naming the step, and exited with 3
    (one process: the exit code itself; under torchrun: the failure report, where a rank stopped by torchrun
    after the first one exited shows SIGTERM)."""
    for rank in range(nproc):
        assert f"llmtrain: stopped on rank {rank}: step {step}: " in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("is not finite; all ranks stop here") == nproc, result.stderr[-3000:]
    if nproc == 1:
        assert result.returncode == 3, result.stderr[-3000:]
        return
    codes = worker_exit_codes(result.stderr)
    assert result.returncode != 0 and 3 in codes and set(codes) <= {3, -15}, (codes, result.stderr[-3000:])


# ---- recipe files for the ${base:...} tests (tests/unit/test_bases.py, tests/e2e/test_bases.py) -----------------

HEADER = """defaults:
  - config
  - override stage: sft
  - override model: tiny_llama
  - override data: reverse
  - _self_
"""
TINY_BASE = "trainer:\n  max_steps: 2\n  micro_batch_size: 8\n"


def write_recipe(path: Path, body: str = TINY_BASE) -> Path:
    path.write_text(HEADER + body)
    return path


def uses_base(ref: str, extra: str = "") -> str:
    return f"model:\n  name_or_path: ${{base:{ref}}}\n  from_config: null\n  tokenizer: null\n{TINY_BASE}{extra}"


# ---- real tokenizers and chat templates (tests/fixtures/tokenizers.py) ------------------------------------------


def save_tiny_model_with_tokenizer(directory: Path, name: str, model_type: str = "llama", seed: int = 0) -> Path:
    """save_tiny_model with fixture tokenizer NAME (llama3, qwen2_5, deepseek, mistral_v3: a real vocabulary, its
    chat template, bos/eos/pad, and a generation_config.json with sampling fields) instead of the shipped tiny one:
    config.json + model.safetensors + the tokenizer's files, in DIRECTORY. fixture_model(name, model_type) in
    tests/fixtures/tokenizers.py caches the same next to the tokenizer."""
    from tests.fixtures.tokenizers import fixture_tokenizer, write_tiny_model

    return write_tiny_model(fixture_tokenizer(name), directory, model_type, seed)


# ---- several runs in one launch (tests/dist/workers/batched_runs.py) -----------------------------------------------

def start_batch(root: Path, name: str, runs: list[dict], nproc: int = 1) -> subprocess.Popen:
    """Starts RUNS ([{"out": folder, "args": [overrides]}], run in order) in one launch of NPROC ranks (torchrun when
    NPROC > 1), the start-up paid once: the launch's own output is on the process's stdout (each run's is in
    batch_log(out))."""
    spec = root / f"{name}.json"
    spec.write_text(json.dumps([{"out": str(r["out"]), "args": list(r["args"])} for r in runs]))
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"]
    return subprocess.Popen([PYTHON, *launcher, "-m", "tests.dist.workers.batched_runs", str(spec)], cwd=REPO,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_batch(root: Path, name: str, runs: list[dict], nproc: int = 1, timeout: int = 1800) -> str:
    """start_batch, waited for: the launch's own output."""
    process = start_batch(root, name, runs, nproc)
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        raise


class BatchedRuns:
    """A module's runs, several per launch (tests/dist/workers/batched_runs.py). LAUNCHES, in order: (nproc,
    [(name, overrides)]), each run into ROOT/name; a run that resumes another's checkpoint comes after it, in the same
    launch or a later one. `runs(name)`: the folder of that run, finished; `runs.log(name)`: every rank's output."""

    def __init__(self, root: Path, launches: list[tuple[int, list[tuple[str, list[str]]]]]):
        self.root = root
        self.outputs = [run_batch(root, f"launch{i}_{nproc}ranks",
                                  [{"out": root / name, "args": args} for name, args in batch], nproc)
                        for i, (nproc, batch) in enumerate(launches) if batch]

    def started(self, name: str) -> Path:
        out = self.root / name
        assert any(out.parent.glob(f"{out.name}.rank*.log")), \
            f"{name} never started (its launch died):\n" + "\n".join(output[-3000:] for output in self.outputs)
        return out

    def __call__(self, name: str) -> Path:
        return assert_batch_ok(self.started(name))

    def log(self, name: str) -> str:
        return batch_log(self.started(name))


def batch_log(out: Path) -> str:
    """Every rank's output of the batched run into folder OUT, rank 0 first."""
    return "".join(p.read_text() for p in sorted(out.parent.glob(f"{out.name}.rank*.log")))


def assert_batch_ok(out: Path) -> Path:
    """The batched run into OUT finished: no rank wrote a traceback (shown if one did), metrics were written."""
    errors = sorted(out.glob("error_rank*.txt"))
    assert not errors, f"{out.name}:\n{errors[0].read_text()[-4000:]}\n{batch_log(out)[-3000:]}"
    assert (out / "metrics.jsonl").is_file(), f"{out.name}: no metrics\n{batch_log(out)[-4000:]}"
    return out


def spawn_ranks(target, messages: int, world: int = 2) -> tuple[list, list]:
    """`target(rank, port, queue)` in `world` spawned processes that can form a gloo group on a free local port:
    (the `messages` items they put on the queue, read before joining them; their exit codes)."""
    import multiprocessing as mp
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=target, args=(rank, port, queue)) for rank in range(world)]
    for worker in workers:
        worker.start()
    received = [queue.get(timeout=120) for _ in range(messages)]
    for worker in workers:
        worker.join(timeout=60)
    return received, [worker.exitcode for worker in workers]


def vllm_environment() -> str:
    """$LLMTRAIN_VLLM_PYTHON, or the engine environment launch/vllm_env.sh builds (once, under a lock) in .cache."""
    import fcntl

    if os.environ.get("LLMTRAIN_VLLM_PYTHON"):
        return os.environ["LLMTRAIN_VLLM_PYTHON"]
    cache = REPO / ".cache"
    cache.mkdir(exist_ok=True)
    with open(cache / "vllm-env.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = subprocess.run(["bash", str(REPO / "launch" / "vllm_env.sh"), str(cache / "vllm-env")],
                               capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, f"launch/vllm_env.sh failed:\n{built.stderr[-3000:]}"
    return built.stdout.strip().splitlines()[-1]


def vllm_grpo_args(out: Path, *extra: str) -> list[str]:
    """A short grpo_tiny run (from the sft_tiny base) through the vLLM engine, with a learning rate that moves the
    weights; `extra` (its steps, the engine's URL, ...) after."""
    return ["recipe=grpo_tiny", "ppo.rollout.prompts_per_step=8", "ppo.rollout.n_samples_per_prompt=4",
            "ppo.rollout.max_new_tokens=8", "ppo.mini_batch_size=16", "trainer.micro_batch_size=8",
            "trainer.eval_batch_size=16", "optim.lr=3e-3", "ppo.rollout.engine=vllm", f"output_dir={out}", *extra]


class JsonServer:
    """A JSON-over-HTTP server on 127.0.0.1 in a thread: each POST's body is kept in `requests` and answered with
    `answer(body) -> (status, json)` (a reward server, ...). `url` ends in /get_reward; close() stops it."""

    def __init__(self, answer):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        requests = self.requests = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                requests.append(body)
                status, reply = answer(body)
                data = json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a slow answer, as it should
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def run_worker(module: str, out: Path, *args: str, ranks: int = 2, timeout: int = 300) -> list[dict]:
    """`torchrun --standalone --nproc_per_node RANKS -m MODULE *ARGS OUT`, a worker that writes OUT/rank_<r>.json on
    each rank (tests/*/workers/): those reports, rank by rank, once it exited 0."""
    import json

    result = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone",
                             "-m", module, *args, str(out)], env=cli_env(), capture_output=True, text=True,
                            timeout=timeout, cwd=REPO)
    assert_ok(result)
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(ranks)]
