"""--suite lora: llmtrain LoRA SFT against llmtrain full SFT, and against TRL's SFTTrainer + peft (issue 11).

    python benchmarks/throughput.py --suite lora [--rounds 3] [--warmup 3] [--steps 20] [--profile] [--all]
    python benchmarks/lora.py trl-sft --model DIR --steps N --warmup W --out R.json [--variant lora|full] [--profile F]
    # CPU-s of forward/backward/update, full vs LoRA:
    python benchmarks/lora.py split --model DIR [--reps 10] [--out R.json]

The second line is one TRL run, as the suite starts it (the llmtrain runs go through llmtrain_worker.py,
i.e. `llmtrain.__main__.main`). Like for like, every contender in its own process, one torch thread, fp32 CPU:
- the same model: the pretrain_tiny base (`${base:pretrain_tiny}`, lora_sft_tiny's, resolved with
  llmtrain.bases.resolve_base: built once into $LLMTRAIN_CACHE; a 2-layer Llama, h=128, 263-token byte
  vocabulary), loaded by llmtrain through `model.name_or_path` and by TRL with `from_pretrained` (sdpa, fp32);
- the same adapters: r=R, alpha=ALPHA, dropout 0, target_modules "all-linear" (every Linear of the decoder
  blocks, lm_head excluded: 14 matrices), bias none, no modules_to_save; peft's own LoRA layers in both
  (llmtrain draws A from a per-module seed instead of peft's global RNG: the same shapes and work);
- the same data: all of llmtrain/assets/data/reverse_train.jsonl ("reverse: abc\\n" -> "cba", 4,000 rows),
  [bos] prompt response [eos] with the loss on response + eos (TRL gets "<s>" + prompt, which the byte
  tokenizer turns into the bos, and appends the eos itself; completion-only loss, its default);
- the same batch: packed rows of MAX_LEN tokens (lora_sft_tiny's data.max_seq_len), ROWS rows per optimizer
  step, no accumulation. llmtrain: data.packing=true (best-fit decreasing, per-sample causal attention);
  TRL: packing=True, packing_strategy="bfd" (which implies padding_free: the ROWS rows flattened into one
  row with position_ids, from which transformers builds the per-sample block mask);
- the same optimizer: AdamW lr LR constant, betas (0.9, 0.95), eps 1e-8, no weight decay, clipping 1.0;
  TRL's gradient checkpointing (on by default) off, as llmtrain's.
Figure of merit: target tokens (labels[:, 1:] != -100: real, non-pad tokens with a loss) per second of wall
clock over whole loop iterations after the warm-up (and per CPU-second of the contender's process), each
counted from the batches the contender trains on (llmtrain logs that count; TRL's collator is wrapped).
Memory: llmtrain's own per-rank model-state bytes (`memory_r0_*` in metrics.jsonl: parameters, gradients,
optimizer state, measured at the first optimizer step); for TRL the same three measured here (gradients just
before the first optimizer step, parameters and AdamW state after it); peak RSS of each process (wait4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import report  # noqa: E402

DATA_FILE = C.REPO / "llmtrain" / "assets" / "data" / "reverse_train.jsonl"
ROWS, MAX_LEN = 32, 64  # lora_sft_tiny: trainer.micro_batch_size 32, data.max_seq_len 64 (here: packed rows)
R, ALPHA = 16, 32.0  # lora_sft_tiny's peft.r / peft.alpha
LR = 5e-3  # lora_sft_tiny's peak lr, here constant
SEED = 1234
LORA_TRL = ("llmtrain lora", "TRL SFTTrainer + peft")
LORA_FULL = ("llmtrain lora", "llmtrain full")


def pretrain_tiny_base() -> str:
    from llmtrain.bases import resolve_base
    from llmtrain.compose import compose_config

    return resolve_base("pretrain_tiny", compose_config)


# ---- TRL worker -----------------------------------------------------------------------------------------------

def state_bytes(model, optimizer) -> dict:
    """Parameters (every storage once) and AdamW state (tensors with ndim > 0: not the step counts), in bytes."""
    seen, params = set(), 0
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            params += p.untyped_storage().nbytes()
    optim = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if hasattr(v, "ndim") and v.ndim > 0)
    return {"params": float(params), "optimizer": float(optim)}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    import workers as W

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # what llmtrain's loader does
    rows = [json.loads(line) for line in DATA_FILE.read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": "<s>" + r["prompt"], "completion": r["response"]} for r in rows])
    peft_config = None
    if args.variant == "lora":
        peft_config = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear", bias="none",
                                 task_type="CAUSAL_LM")
    memory: dict = {}
    with tempfile.TemporaryDirectory() as out:
        common = dict(W.common_training_args(out, args.steps, ROWS), learning_rate=LR)
        config = SFTConfig(**common, gradient_checkpointing=False, packing=True, packing_strategy="bfd",
                           max_length=MAX_LEN)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config)
        recorder = W.Recorder(trainer.data_collator)
        trainer.data_collator = recorder
        trainer.add_callback(recorder.callback())

        class Memory(TrainerCallback):
            def on_pre_optimizer_step(self, args_, state, control, model=None, **kwargs):
                if "grads" not in memory:
                    memory["grads"] = float(sum(p.grad.numel() * p.grad.element_size()
                                                for p in trainer.model.parameters() if p.grad is not None))

            def on_step_end(self, args_, state, control, **kwargs):
                if "params" not in memory:
                    memory.update(state_bytes(trainer.model, trainer.optimizer))

        trainer.add_callback(Memory())
        if args.profile:
            import cProfile
            profiler = cProfile.Profile()
            profiler.runcall(trainer.train)
            profiler.dump_stats(args.profile)
        else:
            trainer.train()
        result = W.finish(recorder, args)
        result["losses"] = recorder.losses
        result["memory"] = memory
        params = list(trainer.model.parameters())
        result["trainable_parameters"] = sum(p.numel() for p in params if p.requires_grad)
        result["parameters"] = sum(p.numel() for p in params)
        result["trl_config"] = {k: getattr(config, k) for k in ("gradient_checkpointing", "packing", "packing_strategy",
                                                               "padding_free", "max_length", "completion_only_loss",
                                                               "per_device_train_batch_size", "bf16")}
        result["trl_config"]["padding_free_effective"] = trainer.padding_free
        result["trl_config"]["model_class"] = type(trainer.model).__name__
    return result


# ---- where a LoRA step's time goes: full and LoRA alternately in one process ---------------------------------

def run_split(args) -> dict:
    """CPU seconds of forward (with the loss), backward and AdamW step of one ROWS x MAX_LEN batch, the base model
    trained in full and with peft's LoRA (the same LoraConfig as the TRL worker), alternately `reps` times in this
    process: neighbours' load moves wall time, much less CPU time. Plain causal sdpa on full rows (the attention is
    the same in both, only the linear layers differ); medians over the reps after one warm-up each."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def build(lora: bool):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
        if lora:
            model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                                     target_modules="all-linear", bias="none"))
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model.train(), torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    torch.manual_seed(SEED)
    ids = torch.randint(0, 256, (ROWS, MAX_LEN))  # (B, T) byte tokens
    contenders = {"full": build(False), "lora": build(True)}
    times = {name: defaultdict(list) for name in contenders}
    for rep in range(args.reps + 1):
        for name, (model, optimizer) in contenders.items():
            t0 = time.process_time()
            loss = model(input_ids=ids, labels=ids).loss
            t1 = time.process_time()
            loss.backward()
            t2 = time.process_time()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.process_time()
            if rep:  # rep 0: warm-up
                for key, value in (("forward", t1 - t0), ("backward", t2 - t1), ("update", t3 - t2), ("step", t3 - t0)):
                    times[name][key].append(value)
    result = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    result["lora_over_full"] = {k: result["lora"][k] / result["full"][k] for k in result["full"]}
    result["reps"] = args.reps
    return result


# ---- the suite ------------------------------------------------------------------------------------------------

def llmtrain_overrides(kind: str, model: str, out_dir: Path, steps: int) -> list[str]:
    peft = ["peft=none"] if kind == "full" else [f"peft.r={R}", f"peft.alpha={ALPHA}", "peft.dropout=0.0",
                                                   "peft.target_modules=all-linear"]
    return ["recipe=lora_sft_tiny", *peft, f"model.name_or_path={model}", "model.from_config=null",
            "model.tokenizer=null", "model.dropout=0.0", f"data.train_files=[{DATA_FILE}]", "data.eval_files=[]",
            "data.packing=true", f"data.max_seq_len={MAX_LEN}", f"trainer.micro_batch_size={ROWS}",
            "trainer.grad_accum_steps=1", f"trainer.max_steps={steps}", f"trainer.seed={SEED}",
            "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=0", "trainer.log_every_n_steps=0",
            f"optim.lr={LR}", "optim.betas=[0.9,0.95]", "optim.eps=1e-8", "optim.weight_decay=0.0",
            "optim.warmup_steps=0", "optim.schedule=constant", "optim.max_grad_norm=1.0", "precision=fp32",
            f"output_dir={out_dir}"]


def contenders(args, tmp: Path, model: str) -> dict:
    import throughput as T

    steps = args.warmup + args.steps

    def profile_flag(out: str, first: bool) -> tuple[str, ...]:
        return ("--profile", str(Path(out).with_suffix(".prof"))) if args.profile and first else ()

    def llmtrain(kind: str):
        def argv(out: str, first: bool) -> list[str]:
            run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{kind}-"))
            return T.llmtrain_worker_argv(out, args.warmup, llmtrain_overrides(kind, model, run_dir, steps),
                                          flags=profile_flag(out, first))
        return argv

    def trl(variant: str):
        return lambda out, first: [T.PY, str(Path(__file__).resolve()), "trl-sft", "--model", model, "--steps",
                                   str(steps), "--warmup", str(args.warmup), "--variant", variant, "--out", out,
                                   *profile_flag(out, first)]

    found = {"llmtrain lora": llmtrain("lora"), "llmtrain full": llmtrain("full"), "TRL SFTTrainer + peft": trl("lora")}
    if args.all:
        found["TRL SFTTrainer full"] = trl("full")
    return T.selected(found, args.only)


def run_suite(args, work: Path, tmp: Path, info: dict) -> dict:
    import throughput as T

    model = pretrain_tiny_base()
    runs = T.run_rounds(contenders(args, tmp, model), args, tmp, T.bench_env(args.threads), suite_timeout=600)
    if args.profile:  # keep the round-0 profiles (the temp dir goes away)
        for prof in tmp.glob("*.prof"):
            target = args.results_dir / f"lora-{prof.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(prof.read_bytes())
    return {"runs": runs, "summary": summarise(runs), "lora": {
        "model": model, "data": f"{DATA_FILE.relative_to(C.REPO)} (all {len(DATA_FILE.read_text().splitlines())} rows)",
        "rows_per_step": ROWS, "max_len": MAX_LEN, "r": R, "alpha": ALPHA, "dropout": 0.0,
        "target_modules": "all-linear", "lr": LR, "seed": SEED}}


MEMORY_KEYS = ("params", "grads", "optimizer")


def memory_of(result: dict) -> dict:
    """params / grads / optimizer bytes: llmtrain's logged memory_r0_* or the TRL worker's measurement."""
    if "memory" in result:
        return {k: result["memory"].get(k) for k in MEMORY_KEYS}
    logged = result.get("logged_memory", {})
    return {k: logged.get(f"memory_r0_{k}") for k in MEMORY_KEYS}


def summarise(runs: list[dict]) -> dict:
    def one(ok: list[dict]) -> dict:
        out = {k: report.spread([r["result"][k] for r in ok]) for k in
               ("tokens_per_s", "tokens_per_cpu_s", "target_tokens_per_step", "median_step_s")}
        out.update(peak_rss_mb=report.spread([r["peak_rss_mb"] for r in ok]),
                   others_load_cores=report.spread([r["foreign_load_cores"] for r in ok]),
                   per_round={r["round"]: {"tokens_per_s": r["result"]["tokens_per_s"],
                                           "tokens_per_cpu_s": r["result"]["tokens_per_cpu_s"],
                                           "others_load_cores": r["foreign_load_cores"]} for r in ok},
                   memory=memory_of(ok[0]["result"]), first_losses=ok[0]["result"].get("losses", [])[:3])
        grads = out["memory"].get("grads")  # llmtrain: fp32 gradients of exactly the trainable parameters
        out["trainable_parameters"] = ok[0]["result"].get("trainable_parameters", int(grads // 4) if grads else None)
        return out

    summary = report.per_contender(runs, "tokens_per_s", one)
    ratios = {}
    for ours, theirs in (LORA_TRL, LORA_FULL):
        a, b = summary.get(ours, {}), summary.get(theirs, {})
        if "tokens_per_s" not in a or "tokens_per_s" not in b:
            continue
        same_round = [a["per_round"][r]["tokens_per_cpu_s"] / b["per_round"][r]["tokens_per_cpu_s"]
                      for r in a["per_round"] if r in b["per_round"]]
        ratios[f"{ours} / {theirs}"] = {
            "tokens_per_s_median": a["tokens_per_s"]["median"] / b["tokens_per_s"]["median"],
            "tokens_per_s_best_round": a["tokens_per_s"]["max"] / b["tokens_per_s"]["max"],
            "tokens_per_cpu_s_median": a["tokens_per_cpu_s"]["median"] / b["tokens_per_cpu_s"]["median"],
            "tokens_per_cpu_s_by_round": same_round,
            "model_state_bytes": _total(a["memory"]) / _total(b["memory"]) if _total(a["memory"]) and
            _total(b["memory"]) else None,
            "peak_rss": a["peak_rss_mb"]["median"] / b["peak_rss_mb"]["median"]}
    summary["_ratios"] = ratios
    return summary


def _total(memory: dict) -> float | None:
    values = [memory.get(k) for k in MEMORY_KEYS]
    return None if any(v is None for v in values) else sum(values)


COLUMNS = ("contender", "target tok/s (median):", "min–max:", "target tok/CPU-s:", "target tok/step:",
           "step s (median):", "trainable params:", "model-state bytes r0 (params + grads + Adam):", "peak RSS MB:",
           "others' load, cores:")


def _bytes(memory: dict) -> str:
    total = _total(memory)
    if total is None:
        return "n/a"
    return (f"{total / 2**20:.2f} MiB ({memory['params'] / 2**20:.2f} + {memory['grads'] / 2**20:.2f} + "
            f"{memory['optimizer'] / 2**20:.2f})")


def table(result: dict) -> str:
    s, p = result["summary"], result["lora"]
    lines = [f"Model {p['model']}; data {p['data']}; packed rows of {p['max_len']} tokens, "
             f"{p['rows_per_step']} rows per "
             f"optimizer step; LoRA r {p['r']}, alpha {p['alpha']}, dropout 0, {p['target_modules']}; AdamW lr "
             f"{p['lr']} constant; fp32, 1 process, 1 thread. Medians over rounds.", "",
             "| " + " | ".join(c.rstrip(":") for c in COLUMNS) + " |",
             "|" + "|".join("---:" if c.endswith(":") else "---" for c in COLUMNS) + "|"]
    for name, e in s.items():
        if name.startswith("_"):
            continue
        if "error" in e:
            lines.append(f"| {name} | failed: {e['error'][:80]} |" + " |" * (len(COLUMNS) - 2))
            continue
        m = lambda key: e[key]["median"]  # noqa: E731
        trainable = e.get("trainable_parameters")
        lines.append(f"| {name} | {m('tokens_per_s'):,.0f} "
                     f"| {e['tokens_per_s']['min']:,.0f}–{e['tokens_per_s']['max']:,.0f} "
                     f"| {m('tokens_per_cpu_s'):,.0f} | {m('target_tokens_per_step'):,.0f} | {m('median_step_s'):.3f} "
                     f"| {f'{trainable:,}' if trainable else 'n/a'} | {_bytes(e['memory'])} "
                     f"| {m('peak_rss_mb'):,.0f} | {m('others_load_cores'):.2f} |")
    lines.append("")
    for key, r in s.get("_ratios", {}).items():
        goal = "; goal ≥ 1.3×" if key == " / ".join(LORA_TRL) else ""
        by_round = ", ".join(f"{v:.2f}×" for v in r["tokens_per_cpu_s_by_round"])
        mem = f"; model-state bytes {r['model_state_bytes']:.3f}×" if r["model_state_bytes"] else ""
        lines.append(f"- {key}: target tok/s **{r['tokens_per_s_median']:.2f}×** by the median (best round "
                     f"{r['tokens_per_s_best_round']:.2f}×), per CPU-second {r['tokens_per_cpu_s_median']:.2f}× "
                     f"(round by round {by_round}){goal}{mem}; peak RSS {r['peak_rss']:.2f}×")
    for name, e in s.items():
        if not name.startswith("_") and e.get("first_losses"):
            lines.append(f"- {name}: first losses (round 0) " + ", ".join(f"{v:.4f}" for v in e["first_losses"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=["trl-sft", "split"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--reps", type=int, default=10, help="split: alternations")
    parser.add_argument("--variant", default="lora", choices=["lora", "full"])
    parser.add_argument("--profile")
    parser.add_argument("--out")
    args = parser.parse_args()
    C.set_threads()
    C.write_result(args.out, run_split(args) if args.contender == "split" else run_trl(args))


if __name__ == "__main__":
    main()
