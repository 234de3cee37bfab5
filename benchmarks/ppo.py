"""--suite ppo: llmtrain GRPO against TRL's GRPOTrainer and llmtrain RLOO against TRL's RLOOTrainer (HF generate,
no vLLM), and llmtrain PPO's time split with and without the KV cache.

    python benchmarks/throughput.py --suite ppo [--rounds 3] [--warmup 2] [--steps 10] [--baseline REV]
    python benchmarks/ppo.py trl-grpo|trl-rloo --model DIR --prompts F --steps N --warmup W --out R.json

`--baseline REV` adds `llmtrain grpo @REV` and `llmtrain rloo @REV`: the same worker and overrides with
PYTHONPATH on a git worktree of REV (checked: each run reports which llmtrain it imported), in the same rounds, so
llmtrain before and after a change are measured side by side.

The second line is one TRL run, as the suite starts it (the llmtrain runs go through llmtrain_worker.py,
i.e. `llmtrain.__main__.main`). Like for like, every contender in its own process, one torch thread, fp32 CPU:
- the same model: the sft_tiny base (`${base:sft_tiny}`, resolved with llmtrain.bases.resolve_base, as the
  recipes do: built once into $LLMTRAIN_CACHE), loaded by llmtrain through `model.name_or_path` and by TRL
  with `from_pretrained` (sdpa, fp32); TRL's reference is its own copy, llmtrain's a frozen copy;
- the same prompts: the first STEPS x PROMPTS_PER_STEP rows of llmtrain/assets/data/reverse_train.jsonl
  (one epoch exactly: each contender samples every prompt once; llmtrain visits them in its seeded
  shuffled order, TRL in file order), tokenised identically ([bos] + bytes: TRL gets "<s>" + prompt, which
  the byte tokenizer turns into the bos, as llmtrain's prompt encoder does);
- the same iteration: PROMPTS_PER_STEP prompts x GROUP samples (temperature 1, no top-p/top-k), at most
  MAX_NEW_TOKENS, then ONE optimizer step over the GROUP*PROMPTS_PER_STEP sequences in micro-batches of
  MICRO (llmtrain: ppo.mini_batch_size = the whole rollout, ppo.epochs=1; TRL: per_device_train_batch_size =
  MICRO, gradient_accumulation_steps = steps_per_generation = rollout / MICRO, num_iterations=1);
- the same objective: group-normalised advantages, clipped surrogate (eps 0.2), k3 KL to the reference as a
  loss term (beta = KL_COEF), token mean over the global batch (TRL loss_type="dapo"; the two losses agree on
  one batch in tests/unit/test_ppo_losses.py::test_clipped_loss_plus_k3_token_mean_equals_trl_dapo);
- the same reward: llmtrain.rewards.reversal.score, plus MISSING_EOS_PENALTY for a response without EOS
  (llmtrain: ppo.reward.missing_eos_penalty; TRL: added in the adapter from completion_ids).
RLOO (llmtrain: the GRPO settings above plus ppo.advantage=rloo, ppo.kl.estimator=k1, ppo.kl.in_reward=true,
ppo.whiten_advantages=false, ppo.loss_agg=seq_mean_token_sum; TRL: RLOOConfig with the same rollout, batch,
beta = KL_COEF, epsilon, num_iterations=1, normalize_advantages=False, its default):
- the same advantages: the score (plus the missing-EOS penalty) minus beta * sum of the k1 KL (old - ref log-probs)
  over the response, minus the leave-one-out mean of the other GROUP - 1 samples' returns; neither normalises;
- both run the same forwards: rollout, the actor's and the reference's log-probs in the experience (the KL is in
  the reward, so llmtrain cannot take the old log-probs from the update), one forward+backward per micro-batch;
- where they differ: TRL's ratio is per sequence (exp of the summed log-ratio) and its loss the mean over sequences
  of -min(ratio * A, clip(ratio) * A); llmtrain's ratio is per token and its loss (seq_mean_token_sum) the mean over
  sequences of the summed per-token clipped terms. With one optimizer step per rollout both ratios are exactly 1,
  no clipping applies, and the gradients are the same, mean over sequences of -A * sum_t grad log p_t (the loss
  values differ: TRL's is -mean(A), llmtrain's -mean(A * length)). With several steps per rollout they would differ.
  TRL also handles unscorable completions (NaN rewards), which this reward never produces.
Figures: steps/s and generated tokens/s (tokens through the first EOS, the EOS counted, as llmtrain's
response_len and TRL's completion_mask count them) over wall clock of whole iterations after the warm-up;
steps per CPU-second (process CPU time over the same window: the steadier figure on a shared machine);
each contender's time split per iteration (generation / experience / update: llmtrain logs its own;
TRL's is measured here by timing the trainer's _generate_single_turn and _generate_and_score_completions).
"""

from __future__ import annotations

import argparse
import contextlib
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

PROMPTS_FILE = C.REPO / "llmtrain" / "assets" / "data" / "reverse_train.jsonl"
PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS, MICRO = 8, 4, 16, 16  # grpo_tiny's rollout; one optimizer step per iteration
KL_COEF, CLIP_EPS, LR, MISSING_EOS_PENALTY = 0.04, 0.2, 1e-5, -0.5
SEED = 1234
GRPO_TRL = ("llmtrain grpo", "TRL GRPOTrainer")
RLOO_TRL = ("llmtrain rloo", "TRL RLOOTrainer")
BASELINED = ("llmtrain grpo", "llmtrain rloo")  # run at --baseline REV too, when given
# ppo.packing on / off, side by side in the same rounds (the ratio of medians: the machine is shared)
PACKED_PAIRS = (("llmtrain grpo, packed", "llmtrain grpo"), ("llmtrain grpo, packed", "TRL GRPOTrainer"),
                ("llmtrain ppo, KV cache, packed", "llmtrain ppo, KV cache"))
# TRL 1.16 leaves GenerationConfig.use_cache unset, and transformers 5 fills it from the checkpoint's
# generation_config.json, which says use_cache=false in every llmtrain export (the model is trained without a
# cache): so as shipped, TRL samples WITHOUT a KV cache from this model. "default" forces the cache on (like for
# like with llmtrain's rollout); "checkpoint_cache" runs TRL as it comes.
TRL_VARIANTS = {"default": {"use_cache": True}, "checkpoint_cache": None}


# ---- inputs -------------------------------------------------------------------------------------------------

def sft_tiny_base() -> str:
    from llmtrain.bases import resolve_base
    from llmtrain.compose import compose_config

    return resolve_base("sft_tiny", compose_config)


def write_prompts(work: Path, count: int) -> Path:
    rows = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines()[:count]]
    path = work / "grpo_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["response"]}) + "\n" for r in rows))
    return path


# ---- TRL worker -----------------------------------------------------------------------------------------------

def trl_trainer(kind: str, out: str, args):
    """(trainer class, its config) for TRL's GRPOTrainer (trl-grpo) or RLOOTrainer (trl-rloo), matched settings."""
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    rollout = PROMPTS_PER_STEP * GROUP
    common = dict(
        output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=rollout // MICRO,
        num_generations=GROUP, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        beta=KL_COEF, epsilon=CLIP_EPS, num_iterations=1, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, max_steps=args.steps,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False, seed=SEED, logging_steps=1,
        shuffle_dataset=False, disable_dropout=True, gradient_checkpointing=False, log_completions=False,
        dataloader_num_workers=0, generation_kwargs=TRL_VARIANTS[args.variant])
    if kind == "trl-rloo":  # k1 KL in the reward, leave-one-out baseline, sequence-level ratio, no normalisation
        return RLOOTrainer, RLOOConfig(**common, normalize_advantages=False)
    return GRPOTrainer, GRPOConfig(**common, loss_type="dapo", scale_rewards="group")


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from llmtrain.rewards.reversal import score

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    eos = tokenizer.eos_token_id
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": "<s>" + r["prompt"], "response": r["response"]} for r in rows])
    clock = defaultdict(list)  # per iteration: generated tokens, scores, seconds in generation / experience

    def reversal_reward(prompts, completions, completion_ids, response=None, **_):
        """TRL's signature around llmtrain's function; the stage's missing-EOS penalty added here."""
        clock["generated_tokens"].append(sum(len(ids) for ids in completion_ids))
        scores = score(prompts, completions, response=response)
        clock["score"].append(statistics.fmean(scores))
        return [s + (0.0 if eos in ids else MISSING_EOS_PENALTY) for s, ids in zip(scores, completion_ids)]

    def timed(name, function):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                clock[name].append(time.perf_counter() - start)
        return wrapper

    with tempfile.TemporaryDirectory() as out:
        trainer_class, config = trl_trainer(args.contender, out, args)

        class Timed(trainer_class):
            pass

        Timed._generate_single_turn = timed("generate_s", trainer_class._generate_single_turn)
        Timed._generate_and_score_completions = timed("experience_s", trainer_class._generate_and_score_completions)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
        trainer = Timed(model=model, reward_funcs=reversal_reward, args=config, train_dataset=dataset,
                        processing_class=tokenizer)

        class StepClock(TrainerCallback):
            def on_step_end(self, args_, state, control, **kwargs):
                clock["times"].append(C.now())
                clock["cpu"].append(time.process_time())

            def on_log(self, args_, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    clock["losses"].append(logs["loss"])

        trainer.add_callback(StepClock())
        trainer.train()
        resolved = {k: getattr(config, k, None) for k in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "num_generations", "beta", "loss_type", "scale_rewards", "normalize_advantages",
            "bf16", "gradient_checkpointing", "use_vllm")}
        resolved["reference_model"] = type(trainer.ref_model).__name__ if trainer.ref_model is not None else None
        # what generate() will run with: transformers merges the checkpoint's generation_config.json under TRL's
        effective = trainer.model._prepare_generation_config(trainer.generation_config)[0]
        resolved["effective_generation_use_cache"] = effective.use_cache
    steps = len(clock["times"])
    split = {}
    for i in range(args.warmup, steps):
        period = clock["times"][i] - clock["times"][i - 1]
        gen, exp = clock["generate_s"][i], clock["experience_s"][i]
        for key, value in (("time_rollout_s", gen), ("time_experience_s", exp - gen),
                           ("time_update_s", period - exp)):
            split.setdefault(key, []).append(value)
    return dict(window(clock["times"], clock["generated_tokens"][:steps], args.warmup, clock["cpu"]),
                split={k: statistics.fmean(v) for k, v in split.items()}, scores=clock["score"][:steps],
                losses=clock["losses"], trl_config=resolved)


def window(times: list[float], generated: list[int], warmup: int, cpu: list[float]) -> dict:
    """common.window_throughput counted in generated tokens, plus steps/s over the same window."""
    w = C.window_throughput(times, generated, warmup, cpu)
    return {"steps_per_s": w["measured_steps"] / w["measured_s"], "generated_tokens_per_s": w["tokens_per_s"],
            "steps_per_cpu_s": w["tokens_per_cpu_s"] / w["target_tokens_per_step"],
            "generated_tokens_per_cpu_s": w["tokens_per_cpu_s"],
            "generated_tokens_per_step": w["target_tokens_per_step"],
            "measured_steps": w["measured_steps"], "measured_s": w["measured_s"], "median_step_s": w["median_step_s"]}


# ---- the suite ------------------------------------------------------------------------------------------------

def llmtrain_overrides(kind: str, model: str, prompts: Path, out_dir: Path, steps: int) -> list[str]:
    """kind: grpo | ppo | ppo_nocache, with `_packed` for ppo.packing=true (padding-free experience and update)."""
    if kind.endswith("_packed"):
        return [*llmtrain_overrides(kind[:-len("_packed")], model, prompts, out_dir, steps), "ppo.packing=true"]
    common = [f"model.name_or_path={model}", "model.from_config=null", "model.tokenizer=null",
              f"trainer.max_steps={steps}", f"trainer.seed={SEED}", "trainer.eval_every_n_steps=0",
              "trainer.save_every_n_steps=0", "trainer.log_every_n_steps=0", "precision=fp32", f"output_dir={out_dir}"]
    if kind == "rloo":  # TRL RLOOTrainer's objective (ppo.py's docstring): k1 KL in the reward, no whitening
        return [*llmtrain_overrides("grpo", model, prompts, out_dir, steps), "ppo.advantage=rloo",
                "ppo.kl.estimator=k1", "ppo.kl.in_reward=true", "ppo.whiten_advantages=false",
                "ppo.loss_agg=seq_mean_token_sum"]
    if kind == "grpo":
        rollout = PROMPTS_PER_STEP * GROUP
        return ["recipe=grpo_tiny", *common, f"data.train_files=[{prompts}]", "data.eval_files=[]",
                f"ppo.rollout.prompts_per_step={PROMPTS_PER_STEP}", f"ppo.rollout.n_samples_per_prompt={GROUP}",
                f"ppo.rollout.max_new_tokens={MAX_NEW_TOKENS}", "ppo.rollout.temperature=1.0",
                f"ppo.mini_batch_size={rollout}", "ppo.epochs=1", f"trainer.micro_batch_size={MICRO}",
                f"ppo.kl.coef={KL_COEF}", f"ppo.clip_eps={CLIP_EPS}", f"optim.lr={LR}", "optim.max_grad_norm=1.0",
                f"ppo.reward.missing_eos_penalty={MISSING_EOS_PENALTY}"]
    # PPO: recipe ppo_tiny as shipped (32 prompts, 2 mini-batches of 16), its own data, no eval
    return ["recipe=ppo_tiny", *common, "data.eval_files=[]", f"ppo.rollout.use_cache={str(kind == 'ppo').lower()}"]


def contenders(args, work: Path, tmp: Path, model: str, prompts: Path) -> dict:
    import throughput as T

    steps = args.warmup + args.steps

    def llmtrain(kind: str):
        def argv(out: str, first: bool) -> list[str]:
            run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{kind}-"))
            return T.llmtrain_worker_argv(out, args.warmup, llmtrain_overrides(kind, model, prompts, run_dir, steps))
        return argv

    def trl(variant: str, trainer: str = "trl-grpo"):
        return lambda out, first: [T.PY, str(Path(__file__).resolve()), trainer, "--model", model, "--prompts",
                                   str(prompts), "--steps", str(steps), "--warmup", str(args.warmup), "--variant",
                                   variant, "--out", out]

    found = {"llmtrain grpo": llmtrain("grpo"), "llmtrain grpo, packed": llmtrain("grpo_packed"),
             "TRL GRPOTrainer": trl("default"),
             "TRL GRPOTrainer, no KV cache (checkpoint default)": trl("checkpoint_cache"),
             "llmtrain rloo": llmtrain("rloo"), "TRL RLOOTrainer": trl("default", "trl-rloo"),
             "llmtrain ppo, KV cache": llmtrain("ppo"), "llmtrain ppo, KV cache, packed": llmtrain("ppo_packed"),
             "llmtrain ppo, no KV cache": llmtrain("ppo_nocache")}
    if args.baseline:  # llmtrain at that commit, the same worker and overrides (its own recipes and conf)
        found.update({baseline_name(name, args.baseline): found[name] for name in BASELINED})
    return T.selected(found, args.only)


def baseline_name(name: str, rev: str) -> str:
    return f"{name} @{rev}"


def baseline_envs(args, contenders: dict, base_dir: Path) -> dict:
    """The baseline contenders' environment: PYTHONPATH on the baseline worktree (`import llmtrain` is the old one)."""
    import throughput as T

    return {name: T.bench_env(args.threads, PYTHONPATH=str(base_dir)) for name in contenders
            if name.endswith(f" @{args.baseline}")}


def run_suite(args, work: Path, tmp: Path, info: dict) -> dict:
    import throughput as T

    model = sft_tiny_base()
    prompts = write_prompts(work, (args.warmup + args.steps) * PROMPTS_PER_STEP)
    found, baseline = contenders(args, work, tmp, model, prompts), {}
    with contextlib.ExitStack() as stack:
        envs = {}
        if args.baseline:
            base_dir = tmp / f"llmtrain-{args.baseline}"
            baseline = {"rev": args.baseline, "commit": stack.enter_context(T.baseline_checkout(args.baseline,
                                                                                                base_dir))}
            envs = baseline_envs(args, found, base_dir)
        runs = T.run_rounds(found, args, tmp, T.bench_env(args.threads), suite_timeout=600, envs=envs)
        if envs:
            expected = {name: (base_dir if name in envs else C.REPO) / "llmtrain" for name in found
                        if name.startswith("llmtrain")}
            baseline["imports"] = T.imported_from([r for r in runs if r["contender"] in expected], expected)
    return {"runs": runs, "summary": summarise(runs), "baseline": baseline, "ppo": {
        "model": model,
        "prompts": f"{PROMPTS_FILE.relative_to(C.REPO)}: first {(args.warmup + args.steps) * PROMPTS_PER_STEP}",
        "prompts_per_step": PROMPTS_PER_STEP, "group": GROUP, "max_new_tokens": MAX_NEW_TOKENS, "micro_batch": MICRO,
        "kl_coef": KL_COEF, "clip_eps": CLIP_EPS, "lr": LR, "missing_eos_penalty": MISSING_EOS_PENALTY}}


SPLIT = ("time_rollout_s", "time_experience_s", "time_update_s")


def summarise(runs: list[dict]) -> dict:
    """Per contender: medians over rounds of steps/s, generated tokens/s (wall and CPU), the time split; the
    llmtrain/TRL ratios by the median, the best round and per CPU-second."""
    def one(ok: list[dict]) -> dict:
        out = {k: report.spread([r["result"][k] for r in ok if k in r["result"]]) for k in
               ("steps_per_s", "steps_per_cpu_s", "generated_tokens_per_s", "generated_tokens_per_cpu_s",
                "generated_tokens_per_step", "median_step_s")}
        out.update({k: report.spread([r["result"]["split"][k] for r in ok]) for k in SPLIT})
        out.update(peak_rss_mb=report.spread([r["peak_rss_mb"] for r in ok]),
                   others_load_cores=report.spread([r["foreign_load_cores"] for r in ok]),
                   first_scores=ok[0]["result"].get("scores", [])[:4])
        return out

    summary = report.per_contender(runs, "steps_per_s", one)
    baselines = [(name, other) for name in BASELINED for other in summary if other.startswith(name + " @")]
    summary["_ratios"] = {f"{a} / {b}": pair_ratios(summary[a], summary[b])
                          for a, b in (GRPO_TRL, RLOO_TRL, *baselines)
                          if "steps_per_s" in summary.get(a, {}) and "steps_per_s" in summary.get(b, {})}
    summary["_packing"] = packing_ratios(summary)
    return summary


RATIO_KEYS = ("steps_per_s", "steps_per_cpu_s", "generated_tokens_per_s", "generated_tokens_per_cpu_s")


def pair_ratios(ours: dict, theirs: dict) -> dict:
    """Per RATIO_KEYS figure: ours / theirs by the median over rounds and by the best rounds; and each phase's
    seconds per iteration, theirs / ours (> 1: ours is faster there)."""
    out = {key: {"median": ours[key]["median"] / theirs[key]["median"],
                 "best round": ours[key]["max"] / theirs[key]["max"]} for key in RATIO_KEYS if key in ours}
    out["phase_speedup"] = {k: theirs[k]["median"] / ours[k]["median"] for k in SPLIT if ours[k]["median"] > 0}
    return out


def packing_ratios(summary: dict) -> dict:
    """Per PACKED_PAIRS pair present: steps/s and each phase's seconds, packed / other, by the median of rounds."""
    out = {}
    for packed, other in PACKED_PAIRS:
        a, b = summary.get(packed, {}), summary.get(other, {})
        if "steps_per_s" in a and "steps_per_s" in b:
            out[f"{packed} / {other}"] = {key: a[key]["median"] / b[key]["median"]
                                          for key in ("steps_per_s", *SPLIT) if b[key]["median"] > 0}
    return out


COLUMNS = ("contender", "steps/s (median):", "min–max:", "steps/CPU-s:", "generated tok/s:", "gen tok/CPU-s:",
           "gen tok/step:", "rollout s:", "experience s:", "update s:", "generation share:", "peak RSS MB:",
           "others' load, cores:")


def table(result: dict) -> str:
    s, p = result["summary"], result["ppo"]
    lines = [f"GRPO: {p['prompts_per_step']} prompts x {p['group']} samples per step, max_new_tokens "
             f"{p['max_new_tokens']}, one optimizer step per iteration in micro-batches of {p['micro_batch']}; "
             f"k3 KL loss β {p['kl_coef']}, clip ε {p['clip_eps']}. RLOO: the same rollout and step, k1 KL in the "
             f"reward (β {p['kl_coef']}), leave-one-out baseline, per-sequence loss mean. PPO: recipe ppo_tiny (32 "
             f"prompts, 2 mini-batches of 16, critic). Model {p['model']}; prompts {p['prompts']}. Split: seconds per "
             "iteration, mean over the timed steps, median over rounds.", "",
             "| " + " | ".join(c.rstrip(":") for c in COLUMNS) + " |",
             "|" + "|".join("---:" if c.endswith(":") else "---" for c in COLUMNS) + "|"]
    for name, e in s.items():
        if name.startswith("_"):
            continue
        if "error" in e:
            lines.append(f"| {name} | failed: {e['error'][:80]} |" + " |" * (len(COLUMNS) - 2))
            continue
        m = lambda key: e[key]["median"]  # noqa: E731
        total = sum(m(k) for k in SPLIT)
        per_cpu = f"{m('steps_per_cpu_s'):.2f}" if e["steps_per_cpu_s"]["n"] else "–"
        lines.append(f"| {name} | {m('steps_per_s'):.2f} | {e['steps_per_s']['min']:.2f}–{e['steps_per_s']['max']:.2f} "
                     f"| {per_cpu} | {m('generated_tokens_per_s'):,.0f} | {m('generated_tokens_per_cpu_s'):,.0f} "
                     f"| {m('generated_tokens_per_step'):.0f} | {m('time_rollout_s'):.3f} "
                     f"| {m('time_experience_s'):.3f} "
                     f"| {m('time_update_s'):.3f} | {m('time_rollout_s') / total:.2f} | {m('peak_rss_mb'):,.0f} "
                     f"| {m('others_load_cores'):.2f} |")
    lines.append("")
    for pair, r in s.get("_packing", {}).items():
        lines.append(f"- {pair}: steps/s **{r['steps_per_s']:.2f}×** by the median; seconds per iteration "
                     + ", ".join(f"{k[5:-2]} {r[k]:.2f}×" for k in SPLIT if k in r))
    for pair, ratios in s.get("_ratios", {}).items():
        figures = "; ".join(f"{key} **{r['median']:.2f}×** (best round {r['best round']:.2f}×)"
                            for key, r in ratios.items() if key in RATIO_KEYS)
        phases = ", ".join(f"{k[5:-2]} {v:.2f}×" for k, v in ratios["phase_speedup"].items())
        lines.append(f"- {pair}: {figures} by the median of rounds; phases faster by {phases}")
    for name in (*GRPO_TRL, *RLOO_TRL):
        if s.get(name, {}).get("first_scores"):
            lines.append(f"- {name}: mean score of its first steps (round 0) "
                         + ", ".join(f"{v:.3f}" for v in s[name]["first_scores"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=["trl-grpo", "trl-rloo"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--variant", default="default", choices=sorted(TRL_VARIANTS))
    parser.add_argument("--out")
    args = parser.parse_args()
    C.set_threads()
    C.write_result(args.out, run_trl(args))


if __name__ == "__main__":
    main()
