"""--suite rollout: GRPO with rollouts through a vLLM server (ppo.rollout.engine=vllm) against llmtrain's own sampling
loop (engine=hf) and TRL's GRPOTrainer (transformers generate), on a ~28M-parameter Llama with 128-token responses;
and the weight sync's time (`sync_s`) against model size.

    python benchmarks/throughput.py --suite rollout --warmup 1 [--rounds 5] [--steps 3] [--no-sync] [--only WORD ...]
    python benchmarks/rollout.py trl-grpo --model DIR --prompts F --steps N --warmup W --out R.json
    python benchmarks/rollout.py llmtrain --out R.json --warmup W -- key=value ...  # llmtrain_worker + engine metrics

Contenders: llmtrain GRPO with engine=vllm, with engine=hf, TRL's GRPOTrainer (HF generate with the KV cache; its
vLLM modes need NCCL), and llmtrain engine=vllm with ppo.packing=true (padding-free experience and update; added after
the README's 3-contender run, `--only` picks any). Like for like, every contender in its own process (one torch
thread), rounds alternating in a rotated order:
- the same model: ROLLOUT_MODEL (Llama, h=512, 8 layers, 8 heads of 64, MLP 1536, untied; 27.7M parameters),
  randomly initialised once (seed 1234) and saved with `save_pretrained`; the vocabulary is the shipped 263-token
  byte tokenizer's: the reversal prompts and reward are written in it, TRL decodes completions with it, and the
  parameters go to the layers (a 32k vocabulary would add 33M parameters of embeddings and head at h=512);
- the same iteration: PROMPTS_PER_STEP prompts x GROUP samples = 32 responses of at most MAX_NEW_TOKENS=128 tokens,
  temperature 1, no top-k / top-p, no ignore_eos; then ONE optimizer step over the 32 sequences in micro-batches of
  MICRO (ppo.py's GRPO settings otherwise: k3 KL loss to the reference, clip 0.2, token mean, the reversal reward);
- the vLLM server (started by llmtrain, `ppo.rollout.vllm.python` = a wrapper that execs the engine interpreter under
  `taskset -c 1` with VLLM_CPU_OMP_THREADS_BIND=1) runs on core 1; every trainer (llmtrain vllm, llmtrain hf, TRL)
  runs under `taskset -c 0`. The hf and TRL contenders thus get one core, the vllm one two (trainer + engine): that
  is the engine's point (the server samples while nothing else runs there), and the table says so.
EOS: the random-init model stops early (at </s> or at byte 0x02, the eos of the checkpoint's generation_config.json
that save_pretrained writes for a default Llama config; llmtrain and TRL both add it to the stop set): 58-71 tokens
on average, measured. No contender is forced to full length (ignore_eos would change the sampler); the figure of
merit counts the tokens actually generated (through the first EOS, as llmtrain's response_len and TRL's
completion_mask count them) per second of wall clock over whole iterations, and the iteration time is reported
beside it with the mean response length, so a contender that drew shorter responses shows it. Batched HF generation
(llmtrain hf, TRL) runs until every row of the batch is done; vLLM stops each sequence at its EOS.
Sync: llmtrain engine=vllm on SYNC_SIZES models, a few steps of a tiny rollout each; `sync_s` (write the weights
to /dev/shm, pause, reload, reset the prefix cache, set the version, resume, read it back) and `sync_verify_s`
(the probe) from metrics.jsonl, median over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import ppo  # noqa: E402
import report  # noqa: E402

VLLM_PYTHON = os.environ.get("LLMTRAIN_VLLM_PYTHON", "/work/vllm-env/venv/bin/python")
ROLLOUT_MODEL = dict(model_type="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                     tie_word_embeddings=False, use_cache=False)
PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS, MICRO = 8, 4, 128, 16
MAX_SEQ_LEN = 160  # the longest reversal prompt (~20 tokens) + 128
TRAINER_CORE, ENGINE_CORE = "0", "1"
# sync only: hidden, layers, heads (head_dim 64), MLP; ~7M, ~28M, ~113M parameters
SYNC_SIZES = ((256, 8, 4, 768), (512, 8, 8, 1536), (768, 12, 12, 3072))
SYNC_STEPS = 4
CONTENDERS = ("llmtrain grpo, engine=vllm", "llmtrain grpo, engine=hf", "TRL GRPOTrainer",
              "llmtrain grpo, engine=vllm, packed")  # the last: ppo.packing=true (padding-free experience, update)


def set_constants() -> None:
    """ppo.py's GRPO settings with this suite's rollout: its TRL adapter and llmtrain overrides read these."""
    ppo.PROMPTS_PER_STEP, ppo.GROUP, ppo.MAX_NEW_TOKENS, ppo.MICRO = PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS, MICRO


def save_model(directory: Path, hidden: int, layers: int, heads: int, mlp: int) -> int:
    fields = dict(ROLLOUT_MODEL, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads, intermediate_size=mlp)
    return C.save_model(directory, fields)


def engine_wrapper(work: Path) -> Path:
    """The `ppo.rollout.vllm.python` llmtrain starts its server with: the engine interpreter on ENGINE_CORE."""
    path = work / "vllm-python"
    path.write_text(f"#!/bin/sh\nexport VLLM_CPU_OMP_THREADS_BIND={ENGINE_CORE} OMP_NUM_THREADS=1\n"
                    f"exec taskset -c {ENGINE_CORE} {VLLM_PYTHON} \"$@\"\n")
    path.chmod(0o755)
    return path


def llmtrain_overrides(engine: str, model: str, prompts: Path, out_dir: Path, steps: int, work: Path) -> list[str]:
    set_constants()
    extra = [f"data.max_seq_len={MAX_SEQ_LEN}", f"ppo.rollout.engine={engine}"]
    if engine == "vllm":
        extra += [f"ppo.rollout.vllm.python={engine_wrapper(work)}"]
    return [*ppo.llmtrain_overrides("grpo", model, prompts, out_dir, steps), *extra]


def contenders(args, work: Path, tmp: Path, model: str, prompts: Path) -> dict:
    import throughput as T

    steps = args.warmup + args.steps
    pin = ("taskset", "-c", TRAINER_CORE)

    def llmtrain(engine: str, *extra: str):
        def argv(out: str, first: bool) -> list[str]:
            run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{engine}-"))
            return [*pin, T.PY, str(Path(__file__).resolve()), "llmtrain", "--out", out, "--warmup",
                    str(args.warmup), "--", *llmtrain_overrides(engine, model, prompts, run_dir, steps, work), *extra]
        return argv

    def trl(out: str, first: bool) -> list[str]:
        return [*pin, T.PY, str(Path(__file__).resolve()), "trl-grpo", "--model", model, "--prompts", str(prompts),
                "--steps", str(steps), "--warmup", str(args.warmup), "--out", out]

    found = dict(zip(CONTENDERS, (llmtrain("vllm"), llmtrain("hf"), trl, llmtrain("vllm", "ppo.packing=true"))))
    return T.selected(found, args.only)


def sync_runs(args, work: Path, tmp: Path, prompts: Path) -> list[dict]:
    """Weight sync time against model size: llmtrain engine=vllm, a tiny rollout (2 prompts x 2, 4 tokens),
    SYNC_STEPS steps; sync_s and sync_verify_s of every step from metrics.jsonl."""
    import throughput as T

    rows = []
    for hidden, layers, heads, mlp in SYNC_SIZES:
        model = work / f"sync-model-{hidden}x{layers}"
        parameters = save_model(model, hidden, layers, heads, mlp)
        run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix="sync-"))
        overrides = [*llmtrain_overrides("vllm", str(model), prompts, run_dir, SYNC_STEPS, work),
                     "ppo.rollout.prompts_per_step=2", "ppo.rollout.n_samples_per_prompt=2",
                     "ppo.rollout.max_new_tokens=4", "ppo.mini_batch_size=4", "trainer.micro_batch_size=4"]
        out = tmp / f"sync-{hidden}x{layers}.json"
        argv = T.llmtrain_worker_argv(str(out), 1, overrides, launcher=("taskset", "-c", TRAINER_CORE, T.PY))
        proc = T.run_process(argv, T.bench_env(args.threads), out.with_suffix(".log"), 900)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
            if (run_dir / "metrics.jsonl").exists() else []
        steps = [r for r in records if "sync_s" in r]
        row = {"parameters": parameters, "hidden": hidden, "layers": layers, "heads": heads, "mlp": mlp,
               "fp32_mb": parameters * 4 / 2**20, "rc": proc["rc"], "wall_s": proc["wall_s"],
               "others_load_cores": proc["foreign_load_cores"],
               "sync_s": [r["sync_s"] for r in steps], "sync_verify_s": [r.get("sync_verify_s") for r in steps],
               "sync_max_abs": [r.get("sync_max_abs") for r in steps]}
        if proc["rc"] != 0 or not steps:
            row["error"] = T.failure_reason(proc["log"])
            row["log_tail"] = Path(proc["log"]).read_text(errors="replace")[-3000:]
        later = [s for s in row["sync_s"][1:] if s]
        row["sync_s_median"] = statistics.median(later) if later else None
        verify = [s for s in row["sync_verify_s"][1:] if s]
        row["sync_verify_s_median"] = statistics.median(verify) if verify else None
        print(f"  sync {parameters / 1e6:6.1f}M params: sync_s {row['sync_s']} verify {row['sync_verify_s']}"
              + (f"  FAILED {row['error']}" if "error" in row else ""), flush=True)
        rows.append(row)
    return rows


def run_suite(args, work: Path, tmp: Path, info: dict) -> dict:
    import throughput as T

    set_constants()
    model = work / "rollout-model"
    parameters = save_model(model, *[ROLLOUT_MODEL[k] for k in ("hidden_size", "num_hidden_layers",
                                                                 "num_attention_heads", "intermediate_size")])
    prompts = ppo.write_prompts(work, (args.warmup + args.steps) * PROMPTS_PER_STEP)
    load_before = T.others_load(5.0)
    runs = T.run_rounds(contenders(args, work, tmp, str(model), prompts), args, tmp, T.bench_env(args.threads),
                        suite_timeout=1200)
    sync = [] if args.no_sync else sync_runs(args, work, tmp, prompts)
    return {"runs": runs, "summary": summarise(runs), "sync": sync, "rollout": {
        "model": dict(ROLLOUT_MODEL, vocab_size=len(C.tokenizer()), parameters=parameters),
        "prompts": f"{ppo.PROMPTS_FILE.relative_to(C.REPO)}: first {(args.warmup + args.steps) * PROMPTS_PER_STEP}",
        "prompts_per_step": PROMPTS_PER_STEP, "group": GROUP, "max_new_tokens": MAX_NEW_TOKENS, "micro_batch": MICRO,
        "max_seq_len": MAX_SEQ_LEN, "kl_coef": ppo.KL_COEF, "clip_eps": ppo.CLIP_EPS, "lr": ppo.LR,
        "trainer_core": TRAINER_CORE, "engine_core": ENGINE_CORE, "vllm_python": VLLM_PYTHON,
        "others_load_before_cores": load_before}}


KEYS = ("steps_per_s", "steps_per_cpu_s", "generated_tokens_per_s", "generated_tokens_per_step", "median_step_s")


def summarise(runs: list[dict]) -> dict:
    """Per contender: medians over rounds; rollout tokens/s = generated tokens / rollout seconds; ratios to TRL."""
    def one(ok: list[dict]) -> dict:
        out = {k: report.spread([r["result"][k] for r in ok if k in r["result"]]) for k in KEYS}
        out.update({k: report.spread([r["result"]["split"][k] for r in ok]) for k in ppo.SPLIT})
        out["rollout_tokens_per_s"] = report.spread([r["result"]["generated_tokens_per_step"]
                                                     / r["result"]["split"]["time_rollout_s"] for r in ok])
        out["iteration_s"] = report.spread([1 / r["result"]["steps_per_s"] for r in ok])
        out["mean_response_len"] = report.spread([r["result"]["generated_tokens_per_step"] / (PROMPTS_PER_STEP * GROUP)
                                                  for r in ok])
        mismatch = [r["result"].get("mismatch", {}) for r in ok]
        out["mismatch"] = {k: report.spread([m[k] for m in mismatch if k in m])
                           for k in sorted({k for m in mismatch for k in m})}
        out.update(peak_rss_mb=report.spread([r["peak_rss_mb"] for r in ok]),
                   others_load_cores=report.spread([r["foreign_load_cores"] for r in ok]))
        return out

    summary = report.per_contender(runs, "steps_per_s", one)
    trl = summary.get("TRL GRPOTrainer", {})
    summary["_ratios"] = {}
    for name in (CONTENDERS[0], CONTENDERS[1], CONTENDERS[3]):
        ours = summary.get(name, {})
        if "steps_per_s" in ours and "steps_per_s" in trl:
            summary["_ratios"][f"{name} / TRL GRPOTrainer"] = {
                "iterations_per_s": ours["steps_per_s"]["median"] / trl["steps_per_s"]["median"],
                "generated_tokens_per_s": (ours["generated_tokens_per_s"]["median"]
                                           / trl["generated_tokens_per_s"]["median"]),
                "rollout_tokens_per_s": (ours["rollout_tokens_per_s"]["median"]
                                         / trl["rollout_tokens_per_s"]["median"])}
    return summary


COLUMNS = ("contender", "iteration s (median):", "min–max:", "gen tok/s (iteration):", "rollout tok/s:",
           "mean response len:", "rollout s:", "experience s:", "update s:", "peak RSS MB:", "others' load, cores:")


def table(result: dict) -> str:
    s, p = result["summary"], result["rollout"]
    m = p["model"]
    lines = [f"GRPO, {p['prompts_per_step']} prompts x {p['group']} samples per iteration, at most "
             f"{p['max_new_tokens']} new tokens, temperature 1, no top-k/top-p; one optimizer step per iteration "
             f"(micro-batches of {p['micro_batch']}). Model: Llama h={m['hidden_size']}, {m['num_hidden_layers']} "
             f"layers, {m['num_attention_heads']} heads, MLP {m['intermediate_size']}, vocab {m['vocab_size']}: "
             f"{m['parameters']:,} parameters, random init, fp32. Trainers on core {p['trainer_core']} (taskset), "
             f"the vLLM server on core {p['engine_core']}. Median over {result['settings']['rounds']} rounds of "
             f"{result['settings']['steps']} timed iterations after {result['settings']['warmup']} warm-up. Others' "
             f"load before the runs {p['others_load_before_cores']:.2f} cores.", "",
             *report._header(*COLUMNS)]
    for name, e in s.items():
        if name.startswith("_"):
            continue
        if "error" in e:
            lines.append(report._failed_row(name, f"failed: {e['error'][:80]}", len(COLUMNS)))
            continue
        med = lambda key: e[key]["median"]  # noqa: E731
        spread = f"{e['iteration_s']['min']:.2f}–{e['iteration_s']['max']:.2f}"
        lines.append(f"| {name} | {med('iteration_s'):.2f} | {spread}"
                     f" | {med('generated_tokens_per_s'):,.0f} | {med('rollout_tokens_per_s'):,.0f} "
                     f"| {med('mean_response_len'):.1f} | {med('time_rollout_s'):.2f} | {med('time_experience_s'):.2f} "
                     f"| {med('time_update_s'):.2f} | {med('peak_rss_mb'):,.0f} | {med('others_load_cores'):.2f} |")
    lines.append("")
    for pair, r in s.get("_ratios", {}).items():
        lines.append(f"- {pair}: iterations/s **{r['iterations_per_s']:.2f}×**, generated tok/s over the iteration "
                     f"{r['generated_tokens_per_s']:.2f}×, rollout tok/s {r['rollout_tokens_per_s']:.2f}× "
                     "(medians of rounds; goal: iteration ≥ 1.3× TRL's)")
    mm = s.get(CONTENDERS[0], {}).get("mismatch", {})
    if mm:
        lines.append("- engine=vllm train–inference mismatch (median of rounds of the run means): "
                     + ", ".join(f"{k} {v['median']:.3g}" for k, v in mm.items()))
    if result.get("sync"):
        lines += ["", "Weight sync (llmtrain engine=vllm; a tiny rollout; median of the syncs after the first):", "",
                  "| model | parameters | fp32 MB | sync_s | sync_verify_s | sync_max_abs |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in result["sync"]:
            shape = f"h={row['hidden']} × {row['layers']} layers"
            if "error" in row:
                lines.append(f"| {shape} | {row['parameters']:,} | {row['fp32_mb']:.0f} | failed: "
                             f"{row['error'][:60]} | | |")
                continue
            mx = max((v for v in row["sync_max_abs"] if v is not None), default=float("nan"))
            lines.append(f"| {shape} | {row['parameters']:,} | {row['fp32_mb']:.0f} | {row['sync_s_median']:.2f} | "
                         f"{row['sync_verify_s_median']:.3f} | {mx:.1e} |")
    return "\n".join(lines)


ENGINE_KEYS = ("sync_s", "sync_verify_s", "sync_max_abs", "mismatch_logp_abs_max", "mismatch_logp_abs_mean",
               "mismatch_kl", "mismatch_frac_outside_clip", "mismatch_is_ratio_mean")


def run_llmtrain(argv: list[str]) -> int:
    """llmtrain_worker.py's run (llmtrain's own entry point, timed), then the engine's per-step metrics
    (ENGINE_KEYS, mean over the timed steps) added to its result as `mismatch`."""
    import llmtrain_worker

    out = argv[argv.index("--out") + 1]
    sys.argv = [llmtrain_worker.__file__, *argv]
    try:
        llmtrain_worker.main()
        rc = 0
    except SystemExit as done:
        rc = done.code or 0
    overrides = [a for a in argv if "=" in a]
    metrics = llmtrain_worker.output_dir(overrides) / "metrics.jsonl"
    if rc == 0 and metrics.exists() and Path(out).exists():
        warmup = int(argv[argv.index("--warmup") + 1])
        steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "samples" in r][warmup:]
        result = json.loads(Path(out).read_text())
        result["mismatch"] = {k: statistics.fmean(r[k] for r in steps) for k in ENGINE_KEYS
                              if steps and all(r.get(k) is not None for r in steps)}
        Path(out).write_text(json.dumps(result, indent=1))
    return rc


def main() -> None:
    if sys.argv[1:2] == ["llmtrain"]:
        sys.exit(run_llmtrain(sys.argv[2:]))
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=["trl-grpo"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--variant", default="default", choices=sorted(ppo.TRL_VARIANTS))
    parser.add_argument("--out")
    args = parser.parse_args()
    set_constants()
    C.set_threads()
    C.write_result(args.out, ppo.run_trl(args))


if __name__ == "__main__":
    main()
