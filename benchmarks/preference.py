"""--suite preference: llmtrain's reward-model and DPO stages against TRL's RewardTrainer and DPOTrainer.

    python benchmarks/throughput.py --suite preference [--rounds 3] [--warmup 2] [--steps 8] [--all]
    python benchmarks/preference.py {trl-rm,trl-dpo} --work DIR --steps N --warmup W --out R.json [--variant V]

The second line is one TRL run, as the suite starts it (the llmtrain runs go through llmtrain_worker.py,
i.e. `llmtrain.__main__.main`). Every contender, in its own process, trains on:
- the same weights: common.MODEL initialised once (common.save_model) into work/model, from which DPO's
  policy and reference both load; for the reward model, a one-label `LlamaForSequenceClassification`
  built from that folder once (its `score` row seeded) and saved to work/reward_model, with a tokenizer
  whose pad is `<unk>`, not the eos: transformers' sequence classifier (TRL) pools at the last token that
  is not the pad, llmtrain at each row's last real token; with pad != eos both pool at the EOS.
  (With pad == eos, TRL's usual fallback, transformers would pool at the token BEFORE the EOS:
  `--all` adds that run as "TRL RewardTrainer, pad = eos", with its pooling counted.)
- the same pairs, in the same order: NUM_PAIRS deterministic prompt/chosen/rejected texts (one byte = one
  token); each side's length ([bos] prompt response [eos]) drawn from common's distribution (log-normal,
  median 100, σ 0.7, [16, 512]); the prompt is a third of the shorter side. TRL reads pairs.json in order
  (sequential sampler); llmtrain reads llmtrain_pairs.jsonl, written so that its shuffled epoch 0 visits
  the pairs in that same order. TRL gets the prompt as "<s>" + prompt, which tokenises to the bos, and
  appends the eos itself: both build [bos] prompt response [eos], the loss on response + eos (DPO).
- the same step: PAIRS_PER_STEP pairs, no accumulation, one process, fp32, AdamW (common.OPTIM: lr 1e-3
  constant, clipping 1.0), dropout 0; DPO sigmoid loss, β = DPO_BETA, the reference computed in the step
  (TRL: precompute_ref_log_probs=False); TRL's gradient checkpointing (on by default) off, as llmtrain.
Figure of merit: pairs per second of wall clock over whole loop iterations after the warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NUM_PAIRS, PAIRS_SEED = 512, 0
PAIRS_PER_STEP = 8  # trainer.micro_batch_size (pairs) = TRL per_device_train_batch_size: 16 rows per forward
DPO_BETA = 0.1
RECIPES = {"reward": "rm_tiny", "dpo": "dpo_tiny"}


# ---- data and models ------------------------------------------------------------------------------------

def generate_pairs(n: int = NUM_PAIRS, seed: int = PAIRS_SEED) -> list[dict]:
    """prompt/chosen/rejected texts; `chosen_length` / `rejected_length` are the token counts of
    [bos] prompt response [eos] on each side, drawn from common's length distribution."""
    rng = random.Random(seed + 1)
    lengths = C.sample_lengths(2 * n, seed)
    text = lambda k: "".join(rng.choice(C.ALPHABET) for _ in range(k))  # noqa: E731
    pairs = []
    for chosen_length, rejected_length in zip(lengths[::2], lengths[1::2]):
        prompt_bytes = max(1, round(min(chosen_length, rejected_length) * C.DATA["prompt_fraction"]) - 1)
        prompt, chosen = text(prompt_bytes), text(chosen_length - 2 - prompt_bytes)
        rejected = chosen
        while rejected == chosen:  # llmtrain drops identical pairs; random texts differ anyway
            rejected = text(rejected_length - 2 - prompt_bytes)
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                      "chosen_length": chosen_length, "rejected_length": rejected_length})
    return pairs


def pair_stats(pairs: list[dict], steps: int) -> dict:
    sides = sorted(p[f"{s}_length"] for p in pairs for s in ("chosen", "rejected"))
    q = lambda f: sides[min(len(sides) - 1, int(f * len(sides)))]  # noqa: E731
    real, padded = [], []
    for step in range(steps):  # one forward of 2P right-padded rows per step, in both llmtrain and TRL
        batch = pairs[step * PAIRS_PER_STEP:(step + 1) * PAIRS_PER_STEP]
        rows = [p[f"{s}_length"] for s in ("chosen", "rejected") for p in batch]
        real.append(sum(rows))
        padded.append(len(rows) * max(rows))
    return {"pairs": len(pairs), "sequences": len(sides), "mean_tokens": sum(sides) / len(sides), "p10": q(0.1),
            "p50": q(0.5), "p90": q(0.9), "max": sides[-1], "min": sides[0],
            "real_tokens_per_step_mean": sum(real) / steps, "padded_tokens_per_step_mean": sum(padded) / steps,
            "steps_counted": steps}


def write_pairs(pairs: list[dict], work: Path) -> None:
    """pairs.json in training order (TRL); llmtrain_pairs.jsonl placed so that llmtrain's epoch-0
    permutation (randperm seeded with trainer.seed) visits the pairs in that order."""
    (work / "pairs.json").write_text(json.dumps(pairs))
    perm = C.llmtrain_permutation(len(pairs), C.INIT_SEED)
    rows = [None] * len(pairs)
    for j, row_index in enumerate(perm):
        rows[row_index] = pairs[j]
    with open(work / "llmtrain_pairs.jsonl", "w") as f:
        for p in rows:
            f.write(json.dumps({k: p[k] for k in ("prompt", "chosen", "rejected")}) + "\n")


def save_reward_model(work: Path) -> int:
    """work/model (the causal LM) + a seeded one-label score row -> work/reward_model, tokenizer pad = <unk>."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the load report lists score.weight as missing: it is, that is the point
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    tokenizer.pad_token = tokenizer.unk_token  # != eos: transformers' classifier then pools at the EOS
    torch.manual_seed(C.INIT_SEED + 1)  # the score row is missing from the causal LM: initialised here, once
    model = AutoModelForSequenceClassification.from_pretrained(work / "model", num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(work / "reward_model")
    tokenizer.save_pretrained(work / "reward_model")
    return sum(p.numel() for p in model.parameters())


def prepare(work: Path, steps: int) -> dict:
    pairs = generate_pairs()
    write_pairs(pairs, work)
    return {"reward_model_parameters": save_reward_model(work), "pairs": pair_stats(pairs, steps)}


# ---- TRL workers ----------------------------------------------------------------------------------------

def trl_rows(work: Path) -> list[dict]:
    return [{"prompt": "<s>" + p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]}
            for p in json.loads((work / "pairs.json").read_text())]


def pair_recorder(collator):
    """workers.Recorder counting pairs (half the rows: chosen rows, then rejected rows) per collated batch."""
    from workers import Recorder

    class PairRecorder(Recorder):
        first_batch = None

        def __call__(self, features):
            batch = self.collator(features)
            self.tokens.append(batch["input_ids"].shape[0] // 2)
            if self.first_batch is None:
                self.first_batch = batch
            return batch

    return PairRecorder(collator)


TRL_VARIANTS = {  # name: extra config fields; "pad_eos": the reward model's tokenizer with pad = eos
    "default": dict(gradient_checkpointing=False),
    "pad_eos": dict(gradient_checkpointing=False),
    "grad_ckpt": dict(gradient_checkpointing=True),  # TRL's default
}


def pooling(batch, pad_id: int) -> dict:
    """Where transformers' sequence classifier pools each row of a TRL batch: at the EOS, or before it."""
    import torch
    ids, mask = batch["input_ids"], batch["attention_mask"]
    eos_index = mask.sum(-1) - 1  # right padding: the last real token is the EOS
    positions = torch.arange(ids.shape[1])
    pooled = (positions * (ids != pad_id)).argmax(-1)  # transformers: the rightmost non-pad token
    return {"pad_token_id": pad_id, "rows": ids.shape[0], "at_eos": int((pooled == eos_index).sum()),
            "before_eos": int((pooled == eos_index - 1).sum())}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    import workers as W

    dataset = Dataset.from_list(trl_rows(args.work))
    fields = dict(TRL_VARIANTS[args.variant], max_length=C.MAX_SEQ_LEN, disable_dropout=True)
    with tempfile.TemporaryDirectory() as out:
        common = W.common_training_args(out, args.steps, PAIRS_PER_STEP)
        if args.contender == "trl-rm":
            tokenizer = AutoTokenizer.from_pretrained(args.work / "reward_model")  # pad = <unk>
            if args.variant == "pad_eos":
                tokenizer.pad_token = tokenizer.eos_token
            model = AutoModelForSequenceClassification.from_pretrained(
                args.work / "reward_model", dtype=torch.float32, attn_implementation="sdpa")
            config = RewardConfig(**common, **fields, center_rewards_coefficient=None)
            trainer = W.sequential(RewardTrainer)(model=model, args=config, train_dataset=dataset,
                                                  processing_class=tokenizer)
        else:
            config = DPOConfig(**common, **fields, precompute_ref_log_probs=False, beta=DPO_BETA,
                               loss_type=["sigmoid"], label_smoothing=0.0)
            trainer = W.sequential(DPOTrainer)(model=C.load_model(args.work / "model"), args=config,
                                               train_dataset=dataset, processing_class=C.tokenizer())
        recorder = pair_recorder(trainer.data_collator)
        trainer.data_collator = recorder
        trainer.add_callback(recorder.callback())
        trainer.train()
        result = C.in_pairs(W.finish(recorder, args))
        result["losses"] = recorder.losses
        result["trl_config"] = {k: getattr(config, k) for k in ("gradient_checkpointing", "bf16", "max_length",
                                                               "per_device_train_batch_size", "max_grad_norm")}
        if args.contender == "trl-rm":
            result["pooling"] = pooling(recorder.first_batch, trainer.processing_class.pad_token_id)
        else:
            result["trl_config"].update(precompute_ref_log_probs=config.precompute_ref_log_probs, beta=config.beta,
                                        loss_type=config.loss_type,
                                        reference_model=type(trainer.ref_model).__name__ if trainer.ref_model else None)
    return result


# ---- the suite --------------------------------------------------------------------------------------------

def llmtrain_overrides(stage: str, work: Path, out_dir: Path, steps: int) -> list[str]:
    o = C.OPTIM
    model_dir = work / ("reward_model" if stage == "reward" else "model")
    extra = ["reward.center_coef=0.0"] if stage == "reward" else [f"dpo.beta={DPO_BETA}", "dpo.loss=sigmoid",
                                                                  "dpo.label_smoothing=0.0"]
    # naming the model overrides the recipe's ${base:sft_tiny} (which would train a base model first)
    return [f"recipe={RECIPES[stage]}", f"model.name_or_path={model_dir}", "model.from_config=null",
            "model.tokenizer=null", "model.dropout=0.0", f"data.train_files=[{work / 'llmtrain_pairs.jsonl'}]",
            "data.eval_files=[]", "data.format=preference", f"data.max_seq_len={C.MAX_SEQ_LEN}", "data.packing=false",
            f"trainer.micro_batch_size={PAIRS_PER_STEP}", "trainer.grad_accum_steps=1", f"trainer.max_steps={steps}",
            f"trainer.seed={C.INIT_SEED}", "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=0",
            "trainer.log_every_n_steps=0", f"optim.lr={o['lr']}", f"optim.betas=[{o['betas'][0]},{o['betas'][1]}]",
            f"optim.eps={o['eps']}", f"optim.weight_decay={o['weight_decay']}", "optim.warmup_steps=0",
            "optim.schedule=constant", f"optim.max_grad_norm={o['max_grad_norm']}", "precision=fp32",
            f"output_dir={out_dir}", *extra]


def contenders(args, work: Path, tmp: Path) -> dict:
    import throughput as T

    steps = args.warmup + args.steps

    def llmtrain(stage: str):
        def argv(out: str, first: bool) -> list[str]:
            run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{stage}-"))
            flags = ("--profile", str(Path(out).with_suffix(".prof"))) if args.profile else ()
            return T.llmtrain_worker_argv(out, args.warmup, llmtrain_overrides(stage, work, run_dir, steps),
                                          flags=flags)
        return argv

    def trl(kind: str, variant: str = "default"):
        return lambda out, first: [T.PY, str(Path(__file__).resolve()), kind, "--work", str(work), "--steps",
                                   str(steps), "--warmup", str(args.warmup), "--variant", variant, "--out", out]

    found = {"llmtrain reward": llmtrain("reward"), "TRL RewardTrainer": trl("trl-rm"),
             "llmtrain dpo": llmtrain("dpo"), "TRL DPOTrainer": trl("trl-dpo")}
    if args.all:
        found.update({"TRL RewardTrainer, pad = eos": trl("trl-rm", "pad_eos"),
                      "TRL RewardTrainer, grad ckpt (TRL default)": trl("trl-rm", "grad_ckpt"),
                      "TRL DPOTrainer, grad ckpt (TRL default)": trl("trl-dpo", "grad_ckpt")})
    return T.selected(found, args.only)


def run_suite(args, work: Path, tmp: Path, info: dict) -> dict:
    import report
    import throughput as T

    prepared = prepare(work, args.warmup + args.steps)
    runs = T.run_rounds(contenders(args, work, tmp), args, tmp, T.bench_env(args.threads), suite_timeout=600)
    if args.profile:  # keep llmtrain's profiles (the temp dir goes away)
        for prof in tmp.glob("*.prof"):
            target = args.results_dir / f"preference-{prof.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(prof.read_bytes())
    return {"runs": runs, "summary": report.summarise_preference(runs), "preference": {
        **prepared, "pairs_per_step": PAIRS_PER_STEP, "dpo_beta": DPO_BETA, "recipes": RECIPES,
        "generator": {"num_pairs": NUM_PAIRS, "seed": PAIRS_SEED}}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=["trl-rm", "trl-dpo"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--variant", default="default", choices=sorted(TRL_VARIANTS))
    parser.add_argument("--out")
    args = parser.parse_args()
    C.set_threads()
    C.write_result(args.out, run_trl(args))


if __name__ == "__main__":
    main()
