"""Throughput and memory of llmtrain side by side with a plain PyTorch loop, HF Trainer and TRL, with an earlier
llmtrain, and per backend.

    python benchmarks/throughput.py --suite cpu-small            # ~5 min on 2 CPU cores
    python benchmarks/throughput.py --suite compare              # llmtrain at --baseline REV against this working tree
    python benchmarks/throughput.py --suite backends --nproc 2   # DDP, ZeRO-1/2/3, ZeRO-3 offload, FSDP2, FSDP2+TP
    python benchmarks/throughput.py --suite gpu                  # MFU; exits with a message without a GPU
    python benchmarks/throughput.py --suite preference           # reward model and DPO vs TRL (pairs/s), preference.py
    python benchmarks/throughput.py --suite ppo                  # GRPO vs TRL GRPOTrainer; PPO's time split, ppo.py
    python benchmarks/throughput.py --suite lora [--profile]     # LoRA vs full SFT, vs TRL SFTTrainer + peft, lora.py
    python benchmarks/throughput.py --suite rollout [--no-sync]  # GRPO engine=vllm / hf vs TRL, 128-token rollouts;
                                                                 # the weight sync vs model size, rollout.py

Every contender runs in its own process (peak RSS is its own, read with wait4), on the same tiny Llama
(same initial weights), the same generated variable-length SFT data (common.DATA), AdamW with the same
settings and global batch, fp32 on CPU. Contenders alternate, round after round, in a rotating order;
the first steps of each run are warm-up and not timed; the figure of merit is target tokens (non-pad,
non-masked, after the one-token shift) per second of wall clock over whole loop iterations, counted from
each contender's own batches. Results: benchmarks/results/<suite>.json, the table in <suite>.md and on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import report  # noqa: E402

HERE = Path(__file__).resolve().parent
PY = sys.executable


# ---- one contender run, in its own process -----------------------------------------------------------

def _cpu_ticks() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields[:8]) - idle, os.sysconf("SC_CLK_TCK")


def others_load(seconds: float = 1.0) -> float:
    """Busy cores on the machine over `seconds` (this process sleeps meanwhile)."""
    busy0, hz = _cpu_ticks()
    time.sleep(seconds)
    return (_cpu_ticks()[0] - busy0) / hz / seconds


def wait_for_quiet(max_wait_s: float, threshold: float = 0.5) -> float:
    """Wait (at most max_wait_s) until the rest of the machine uses under `threshold` cores; seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s and others_load() >= threshold:
        pass
    return time.perf_counter() - start


def run_process(argv: list[str], env: dict, log_path: Path, timeout_s: float) -> dict:
    """Run argv to completion; its own peak RSS and CPU seconds from wait4, and the CPU load of everything
    else on the machine while it ran (busy cores from /proc/stat minus its own CPU time)."""
    busy0, hz = _cpu_ticks()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=C.REPO,
                                start_new_session=True)
        deadline = start + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, 9)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    wall = time.perf_counter() - start
    busy1, _ = _cpu_ticks()
    own_cpu = usage.ru_utime + usage.ru_stime
    return {"rc": proc.returncode, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "cpu_s": own_cpu,
            "foreign_load_cores": max(0.0, ((busy1 - busy0) / hz - own_cpu) / wall), "log": str(log_path)}


def failure_reason(log_path: str) -> str:
    lines = [line.strip() for line in Path(log_path).read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if any(k in line for k in ("Error", "error:", "Exception", "stopped"))]
    return (errors[-1] if errors else (lines[-1] if lines else "no output"))[:300]


def prepare(work: Path) -> dict:
    samples = C.generate_samples()
    (work / "samples.json").write_text(json.dumps(samples))
    C.write_llmtrain_jsonl(samples, work / "llmtrain.jsonl", seed=C.INIT_SEED)
    return {"parameters": C.save_model(work / "model"), "data": C.data_stats(samples)}


# ---- llmtrain command lines ------------------------------------------------------------------------------

def bench_env(threads: int, **extra: str) -> dict:
    """The environment of every contender process: `threads` torch/OpenMP threads, no progress bars or
    warnings on the log."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                HF_DATASETS_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
                **extra)


def llmtrain_overrides(work: Path, out_dir: Path, *, steps: int, micro_batch: int, packing: bool,
                       extra: tuple[str, ...] = (), model_dir: Path | None = None,
                       precision: str = "fp32") -> list[str]:
    o = C.OPTIM
    return ["recipe=sft_tiny", "model.from_config=null", f"model.name_or_path={model_dir or work / 'model'}",
            f"model.tokenizer={C.TOKENIZER_DIR}", f"data.train_files=[{work / 'llmtrain.jsonl'}]", "data.eval_files=[]",
            "data.format=prompt_response", f"data.max_seq_len={C.MAX_SEQ_LEN}", f"data.packing={str(packing).lower()}",
            f"trainer.micro_batch_size={micro_batch}", "trainer.grad_accum_steps=1", f"trainer.max_steps={steps}",
            f"trainer.seed={C.INIT_SEED}", "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=0",
            "trainer.log_every_n_steps=0", f"optim.lr={o['lr']}", f"optim.betas=[{o['betas'][0]},{o['betas'][1]}]",
            f"optim.eps={o['eps']}", f"optim.weight_decay={o['weight_decay']}", "optim.warmup_steps=0",
            "optim.schedule=constant", f"optim.max_grad_norm={o['max_grad_norm']}", f"precision={precision}",
            f"output_dir={out_dir}", *extra]


def llmtrain_worker_argv(out: str, warmup: int, overrides: list[str], *, flags: tuple[str, ...] = (),
                         launcher: tuple[str, ...] = (PY,)) -> list[str]:
    """llmtrain_worker.py (llmtrain's own entry point, timed) under `launcher` (python, or torchrun ...)."""
    return [*launcher, str(HERE / "llmtrain_worker.py"), "--out", out, "--warmup", str(warmup), *flags, "--",
            *overrides]


def llmtrain_contender(args, work: Path, tmp: Path, packed: bool, extra: tuple[str, ...] = ()):
    """One process of llmtrain on cpu-small's model, data and global batch; its first run checks that the
    packed samples stay apart. Which llmtrain it imports is up to the environment (see suite_compare)."""
    steps = args.warmup + args.steps
    micro = C.GLOBAL_BATCH_ROWS_PACKED if packed else C.GLOBAL_BATCH_SAMPLES

    def argv(out: str, first: bool) -> list[str]:
        run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix="run-"))
        return llmtrain_worker_argv(out, args.warmup, llmtrain_overrides(work, run_dir, steps=steps, micro_batch=micro,
                                                                         packing=packed, extra=extra),
                                    flags=("--check-packing",) if packed and first else ())
    return argv


def selected(contenders: dict, only: list[str] | None) -> dict:
    """--only: the contenders named by one of the words, or whose name contains a word that names no contender
    ("llmtrain grpo" is that contender alone, "grpo" every contender with grpo in its name)."""
    if not only:
        return contenders
    names = {k.lower() for k in contenders}
    exact = {o.lower() for o in only} & names
    return {k: v for k, v in contenders.items()
            if k.lower() in exact or any(o.lower() in k.lower() for o in only if o.lower() not in exact)}


def run_rounds(contenders: dict, args, tmp: Path, env: dict, suite_timeout: float,
               envs: dict[str, dict] | None = None) -> list[dict]:
    """Every contender once per round, in an order rotated each round; envs: a contender's own environment."""
    runs, names = [], list(contenders)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: no contender always runs first
        for name in order:
            out = tmp / f"{name.replace(' ', '_').replace(',', '').replace('+', 'p').replace('@', '_at_')}-{r}.json"
            argv = contenders[name](str(out), r == 0)
            waited = wait_for_quiet(args.quiet_wait) if args.quiet_wait else 0.0
            proc = dict(run_process(argv, (envs or {}).get(name, env), out.with_suffix(".log"), suite_timeout),
                        waited_for_quiet_s=waited)
            result = json.loads(out.read_text()) if out.exists() else {}
            ranks = sorted(out.parent.glob(out.name + ".rank*"))
            run = {"contender": name, "round": r, **proc, "result": result,
                   "other_ranks": [json.loads(p.read_text()) for p in ranks]}
            if proc["rc"] != 0 or not result:
                run["error"] = failure_reason(proc["log"])
            runs.append(run)
            if "tokens_per_s" in result:
                status = f"{result['tokens_per_s']:8.0f} tok/s"
            elif "pairs_per_s" in result:
                status = f"{result['pairs_per_s']:8.2f} pairs/s"
            elif "steps_per_s" in result:  # ppo suite
                status = f"{result['steps_per_s']:8.2f} steps/s {result['generated_tokens_per_s']:6.0f} gen tok/s"
            else:
                status = "FAILED " + run.get("error", "")
            print(f"  round {r} {name:<32} {status}  (wall {proc['wall_s']:.0f}s, others' load "
                  f"{proc['foreign_load_cores']:.2f} cores)", flush=True)
    return runs


# ---- cpu-small ---------------------------------------------------------------------------------------------

PACKED_TRL = ("padding_free", "packing_bfd", "packing_wrapped")


def cpu_contenders(args, work: Path, tmp: Path) -> dict:
    steps = args.warmup + args.steps
    common = ["--work", str(work), "--steps", str(steps), "--warmup", str(args.warmup)]

    def worker(*extra):
        return lambda out, first: [PY, str(HERE / "workers.py"), *extra, *common, "--out", out] + \
            (["--check"] if first and "trl" in extra and any(v in extra for v in PACKED_TRL) else [])

    contenders = {
        "plain loop": worker("plain"),
        "llmtrain unpacked": llmtrain_contender(args, work, tmp, packed=False),
        "llmtrain packed": llmtrain_contender(args, work, tmp, packed=True),
        # other batches than the rest (similar lengths together): compare its tokens/s, not its losses
        "llmtrain unpacked, group_by_length": llmtrain_contender(args, work, tmp, packed=False,
                                                                 extra=("data.group_by_length=true",)),
        "HF Trainer": worker("hf"),
        "TRL default": worker("trl", "--variant", "default"),
        "TRL padding_free": worker("trl", "--variant", "padding_free"),
        "TRL packing bfd": worker("trl", "--variant", "packing_bfd"),
        "TRL packing wrapped": worker("trl", "--variant", "packing_wrapped"),
    }
    if args.all:  # TRL's default except gradient checkpointing (TRL turns it on by default; the others do not)
        contenders["TRL default, no grad ckpt"] = worker("trl", "--variant", "default_nogc")
    return selected(contenders, args.only)


def suite_cpu_small(args, work: Path, tmp: Path, info: dict) -> dict:
    runs = run_rounds(cpu_contenders(args, work, tmp), args, tmp, bench_env(args.threads), suite_timeout=600)
    return {"runs": runs, "summary": report.summarise_cpu(runs)}


# ---- compare: llmtrain at a baseline commit against llmtrain of this working tree ---------------------------

@contextlib.contextmanager
def baseline_checkout(rev: str, path: Path):
    """A detached `git worktree` of `rev` at `path` (its llmtrain/, conf/ and recipes/ as committed), removed
    afterwards; yields the full commit id."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=C.REPO, check=True, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    git("worktree", "add", "--detach", str(path), commit)
    try:
        yield commit
    finally:
        done = subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=C.REPO, capture_output=True,
                              text=True)
        if done.returncode != 0:
            print(f"warning: could not remove the worktree {path}: {done.stderr.strip()}", flush=True)


def imported_from(runs: list[dict], expected: dict[str, Path]) -> dict:
    """Each run's `llmtrain.__file__` (every rank) against the package dir its contender must import."""
    wrong = []
    for run in runs:
        for res in [run["result"], *run["other_ranks"]]:
            found = res.get("llmtrain_file")
            if res and (found is None
                        or not Path(found).resolve().is_relative_to(expected[run["contender"]].resolve())):
                wrong.append(f"{run['contender']} round {run['round']}: imported {found}, not from "
                             f"{expected[run['contender']]}")
    if wrong:
        raise SystemExit("suite compare: a contender ran the wrong llmtrain:\n  " + "\n  ".join(wrong))
    return {name: str(path) for name, path in expected.items()}


def suite_compare(args, work: Path, tmp: Path, info: dict) -> dict:
    """llmtrain at --baseline and llmtrain of this working tree, alternately, unpacked and packed, on
    cpu-small's model, data and batch. The baseline runs the same worker with PYTHONPATH on a worktree of
    the baseline commit, so `import llmtrain` there is the old package (checked on every run)."""
    rev = args.baseline = args.baseline or "eff726e"
    base_dir = tmp / f"llmtrain-{rev}"
    env = bench_env(args.threads)
    env.pop("PYTHONPATH", None)  # the working tree's llmtrain: the editable install of this checkout
    with baseline_checkout(rev, base_dir) as commit:
        contenders, envs, expected = {}, {}, {}
        for layout, packed in (("unpacked", False), ("packed", True)):
            old, new = report.baseline_name(rev, layout), f"llmtrain {layout}"
            contenders[old] = contenders[new] = llmtrain_contender(args, work, tmp, packed)
            envs[old] = bench_env(args.threads, PYTHONPATH=str(base_dir))
            expected[old], expected[new] = base_dir / "llmtrain", C.REPO / "llmtrain"
        contenders = selected(contenders, args.only)
        runs = run_rounds(contenders, args, tmp, env, suite_timeout=600, envs=envs)
    imports = imported_from(runs, {name: expected[name] for name in contenders})
    return {"runs": runs, "baseline": {"rev": rev, "commit": commit, "imports": imports},
            "summary": report.summarise_compare(runs)}


# ---- backends ----------------------------------------------------------------------------------------------

BACKENDS = ["ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2", "fsdp2_tp"]


def suite_backends(args, work: Path, tmp: Path, info: dict) -> dict:
    steps = args.warmup + args.steps + 1  # + the step whose collectives are counted (not timed)
    contenders = {}
    for backend in args.backends or BACKENDS:
        dp = args.nproc // (2 if backend == "fsdp2_tp" else 1)
        micro = C.GLOBAL_BATCH_SAMPLES // dp

        def argv(out, first, backend=backend, micro=micro):
            run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{backend}-"))
            overrides = llmtrain_overrides(work, run_dir, steps=steps, micro_batch=micro, packing=False,
                                           extra=(f"backend={backend}",))
            return llmtrain_worker_argv(out, args.warmup, overrides, flags=("--comm-step", str(steps)),
                                        launcher=(PY, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc_per_node", str(args.nproc)))
        contenders[backend] = argv
    runs = run_rounds(contenders, args, tmp, bench_env(1), suite_timeout=300)
    counted = C.padded_tokens_of_step(steps - 1, C.GLOBAL_BATCH_SAMPLES)
    return {"runs": runs, "summary": report.summarise_backends(runs, info["parameters"], args.nproc, counted)}


# ---- gpu ---------------------------------------------------------------------------------------------------

def gpu_missing() -> bool:
    import torch
    if torch.cuda.is_available():
        return False
    print("suite gpu: no CUDA device on this machine (torch.cuda.is_available() is False); nothing measured, "
          "no results written. On a GPU machine it reports target tokens/s and MFU of llmtrain (unpacked, packed) "
          "and the plain loop.")
    return True


def suite_gpu(args, work: Path, tmp: Path, info: dict) -> dict:
    import gpu
    return gpu.run_suite(args, work, tmp, info)


# ---- preference: reward model and DPO against TRL (preference.py) --------------------------------------------

def suite_preference(args, work: Path, tmp: Path, info: dict) -> dict:
    import preference
    return preference.run_suite(args, work, tmp, info)


# ---- ppo: GRPO against TRL's GRPOTrainer, PPO's time split with and without the KV cache (ppo.py) ------------

def suite_ppo(args, work: Path, tmp: Path, info: dict) -> dict:
    import ppo
    return ppo.run_suite(args, work, tmp, info)


# ---- rollout: GRPO with engine=vllm / engine=hf against TRL, 128-token rollouts; weight sync time (rollout.py) ---

def suite_rollout(args, work: Path, tmp: Path, info: dict) -> dict:
    import rollout
    return rollout.run_suite(args, work, tmp, info)


# ---- lora: LoRA SFT against full SFT and against TRL's SFTTrainer + peft (lora.py) ---------------------------

def suite_lora(args, work: Path, tmp: Path, info: dict) -> dict:
    import lora
    return lora.run_suite(args, work, tmp, info)


# ---- main --------------------------------------------------------------------------------------------------

def machine() -> dict:
    def cmd(*argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True, cwd=C.REPO, timeout=30).stdout.strip()
        except Exception as error:  # noqa: BLE001
            return f"unavailable ({error})"

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    versions = {}
    for name in ("torch", "transformers", "trl", "deepspeed", "datasets", "accelerate"):
        versions[name] = cmd(PY, "-c", f"import importlib.metadata as m; print(m.version('{name}'))")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(os.sysconf("SC_PAGE_SIZE") *
            os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "python": platform.python_version(), "versions": versions,
            "commit": cmd("git", "rev-parse", "HEAD"),
            "uncommitted_llmtrain_changes": cmd("git", "diff", "--shortstat", "HEAD", "--", "llmtrain"),
            "load_average_before": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["cpu-small", "compare", "backends", "gpu", "preference", "ppo", "lora",
                                                  "rollout"],
                        required=True)
    parser.add_argument("--baseline",
                        help="compare: the llmtrain commit to run against the working tree (default eff726e, the "
                             "last commit before per-sample attention, best-fit packing and the DDP changes); ppo: "
                             "also run llmtrain grpo and rloo at this commit (default: not)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks for --suite backends")
    parser.add_argument("--rounds", type=int, help="default: 3 (cpu-small, compare, gpu, rollout), 1 (backends)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    parser.add_argument("--steps", type=int, help="timed steps per run (default: 5; backends 4, gpu 20, preference 8, "
                        "ppo 10, rollout 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per contender (cpu-small, compare)")
    parser.add_argument("--only", nargs="*", help="contenders whose name contains one of these words")
    parser.add_argument("--backends", nargs="*", choices=BACKENDS)
    parser.add_argument("--all", action="store_true",
                        help="cpu-small: also TRL's default without gradient checkpointing; preference: also TRL's "
                             "reward model with pad = eos, and both TRL trainers with their default gradient "
                             "checkpointing")
    parser.add_argument("--profile", action="store_true", help="preference: cProfile every llmtrain run, kept as "
                        "results/preference-<contender>-<round>.prof; lora: cProfile of each contender's "
                        "round-0 run (llmtrain and TRL), kept as results/lora-<contender>-0.prof")
    parser.add_argument("--peak-tflops", type=float, help="gpu suite: the device's dense bf16 peak, if not known")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="before each run wait up to this many seconds for the machine's other load to drop "
                             "under 0.5 cores (a shared machine); 0: do not wait")
    parser.add_argument("--no-sync", action="store_true", help="rollout: leave out the weight-sync runs")
    parser.add_argument("--results-dir", type=Path, default=HERE / "results")
    args = parser.parse_args()
    args.rounds = args.rounds or {"backends": 1, "gpu": 3}.get(args.suite, 3)
    args.steps = args.steps or {"backends": 4, "gpu": 20, "preference": 8, "ppo": 10, "lora": 20,
                                "rollout": 3}.get(args.suite, 5)
    suite = {"cpu-small": suite_cpu_small, "compare": suite_compare, "backends": suite_backends,
             "gpu": suite_gpu, "preference": suite_preference, "ppo": suite_ppo, "lora": suite_lora,
             "rollout": suite_rollout}[args.suite]
    if args.suite == "gpu" and gpu_missing():
        return
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="llmtrain-bench-") as tmp_name:
        tmp = Path(tmp_name)
        work = tmp / "work"
        work.mkdir()
        info = prepare(work)
        host = machine()
        own_model = args.suite in ("ppo", "lora", "rollout")  # ppo, lora: the sft_tiny base; rollout: its own
        size = "" if own_model else f"{info['parameters']:,} parameters, "
        print(f"suite {args.suite}: {size}{args.rounds} round(s), warm-up {args.warmup} + "
              f"{args.steps} timed steps; load average {host['load_average_before']}", flush=True)
        body = suite(args, work, tmp, info)
        for run in body["runs"]:  # logs live in the temp dir: keep the tail of failed ones
            if run.get("error"):
                run["log_tail"] = Path(run["log"]).read_text(errors="replace")[-3000:]
            run.pop("log", None)
    result = {"suite": args.suite,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": dict(host, load_average_after=os.getloadavg()),
              "model": dict(C.MODEL, **{"parameters": info["parameters"]}),
              "data": dict(C.DATA, **info["data"], max_seq_len=C.MAX_SEQ_LEN), "optim": C.OPTIM,
              "global_batch": {"unpacked_samples": C.GLOBAL_BATCH_SAMPLES, "packed_rows": C.GLOBAL_BATCH_ROWS_PACKED},
              "wall_s": time.time() - started, **body}
    if args.suite in ("preference", "ppo", "lora", "rollout"):  # own pairs or prompts and batch, not SFT samples
        result.pop("data"), result.pop("global_batch")
    if args.suite in ("ppo", "lora", "rollout"):  # its own model (result[suite]["model"]), not common.MODEL
        result.pop("model")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{args.suite}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    if args.suite == "rollout":
        import rollout
        table = rollout.table(result)
    else:
        table = report.table(result)
    path.with_suffix(".md").write_text(table + "\n")
    print()
    print(table)
    print(f"\nwrote {path.relative_to(C.REPO) if path.is_relative_to(C.REPO) else path} "
          f"({result['wall_s']:.0f} s; load average after {result['machine']['load_average_after']})")


if __name__ == "__main__":
    main()
