"""SFT -> RM / DPO / GRPO, and RM -> PPO, with real tokenizers and chat templates (tests/fixtures/tokenizers.py)
on tiny models.

Per fixture (Llama 3: eos <|end_of_text|>, end of turn <|eot_id|>, no pad; Qwen2.5: <|endoftext|> / <|im_end|>,
pad = eos, a system prompt the template adds; Mistral v3: </s> ends both, a 32k sentencepiece vocabulary): one SFT
run on the reversal task as chat `messages`, from a random tiny model with the fixture's 32k-152k vocabulary, is
shared by the module's tests. From its export: GRPO samples replies that stop at the template's end of turn
(eos_rate > 0.9 at iteration 1, and the run log names that token among the stop tokens); a reward model and DPO run
two steps each on chat preference pairs (chosen = the reversal, rejected = the word unreversed) with sane first-step
metrics (DPO: ln 2); on Llama 3, PPO scores with that reward model (which added a <|pad|> token: Llama 3 has
neither pad nor unk) and starts its critic from it. DeepSeek-V3's template opens a generation with `<think>` but
renders a past answer without it, so it does not render turns incrementally: SFT on messages is refused with the
project's message.

Runs are small (micro-batches of 4-16, sequences of 12-40 tokens, max_seq_len 64): a 152k vocabulary makes every
token's logits 600 KB. The runs go two at a time (one CPU core each).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.tokenizers import fixture_info, fixture_model
from tests.helpers import REPO, assert_ok, read_metrics, run_cli, run_cli_jobs

pytestmark = pytest.mark.e2e

DATA = REPO / "llmtrain" / "assets" / "data"
MODEL_TYPES = {"llama3": "llama", "qwen2_5": "qwen2", "mistral_v3": "llama"}
# 40 steps of 8 at lr 1e-2 end every sampled reply (eos_rate 1.0 on each fixture); at 3e-3, or 25 steps, Llama 3's
# fell to 0.38 / 0.91
SFT_ROWS, SFT_STEPS, SFT_MICRO, SFT_LR = 512, 40, 8, 1e-2
PROMPTS, PROMPTS_PER_STEP = 32, 8  # GRPO: 8 prompts x 4 samples = one mini-batch (on-policy, one optimizer step)
PAIRS, PAIR_MICRO = 32, 4
PPO_FIXTURES = ["llama3"]  # SFT -> RM -> PPO where the reward model adds a <|pad|> token to the vocabulary


def rows(source: Path, limit: int) -> list[dict]:
    return [json.loads(line) for line in source.read_text().splitlines()[:limit]]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def as_messages(source: Path, target: Path, limit: int) -> Path:
    """{"prompt": "reverse: abc\\n", "response": "cba"} -> user "reverse: abc", assistant "cba"."""
    return write_jsonl(target, [{"messages": [{"role": "user", "content": r["prompt"].strip()},
                                              {"role": "assistant", "content": r["response"]}]}
                                for r in rows(source, limit)])


def as_chat_pairs(source: Path, target: Path, limit: int) -> Path:
    """TRL's conversational preference layout: chosen = the reversal, rejected = the word as the prompt has it
    (palindromes, whose two replies are equal, left out)."""
    pairs = []
    for r in rows(source, limit):
        word = r["prompt"].strip().removeprefix("reverse:").strip()
        if word != r["response"]:
            pairs.append({"prompt": [{"role": "user", "content": r["prompt"].strip()}],
                          "chosen": [{"role": "assistant", "content": r["response"]}],
                          "rejected": [{"role": "assistant", "content": word}]})
    return write_jsonl(target, pairs)


def stop_token_ids(stderr: str) -> list[int]:
    """The ids named in the run log's `stop tokens: <tok> (id, source), ...` line."""
    line = next((line for line in stderr.splitlines() if "stop tokens: " in line), None)
    assert line is not None, stderr[-3000:]
    return [int(i) for i in re.findall(r"\((\d+), [^)]*\)", line.split("stop tokens: ", 1)[1])]


@dataclass
class Trained:
    name: str
    export: Path  # the SFT run's hf/
    vocab: int
    end_of_turn: int
    root: Path
    timings: dict  # seconds per stage, wall clock of the CLI process (imports and data included)
    chains: dict  # the module's runs (the chains fixture)


@pytest.fixture(scope="module")
def timings(tmp_path_factory) -> dict:
    """{fixture: {stage: seconds of the CLI process, eos_rate}} of this module's runs, written at the end to
    real_tokenizer_timings.json in pytest's base temp folder (and printed: `pytest -s` shows it)."""
    measured: dict = {}
    yield measured
    (tmp_path_factory.getbasetemp() / "real_tokenizer_timings.json").write_text(json.dumps(measured, indent=1))
    print("\nreal tokenizer runs:", json.dumps(measured))


def sft_args(model: Path, train: Path) -> list[str]:
    return ["recipe=sft_tiny", f"model.name_or_path={model}", "model.from_config=null", "model.tokenizer=null",
            "data.format=messages", f"data.train_files=[{train}]", "data.eval_files=[]", "data.eval_fraction=0",
            "data.max_seq_len=64", f"trainer.max_steps={SFT_STEPS}", f"trainer.micro_batch_size={SFT_MICRO}",
            "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=0", f"optim.lr={SFT_LR}",
            "optim.warmup_steps=5"]


def grpo_args(export: Path, prompts: Path) -> list[str]:
    return ["recipe=grpo_tiny", f"model.name_or_path={export}", "data.format=messages", f"data.train_files=[{prompts}]",
            "data.eval_files=[]", "data.eval_fraction=0", "data.max_seq_len=64", "trainer.max_steps=1",
            "trainer.eval_every_n_steps=0", f"ppo.rollout.prompts_per_step={PROMPTS_PER_STEP}",
            "ppo.rollout.n_samples_per_prompt=4", f"ppo.mini_batch_size={PROMPTS_PER_STEP * 4}", "ppo.epochs=1"]


def pair_args(recipe: str, export: Path, pairs: Path) -> list[str]:
    """Two steps of a pairwise recipe from the SFT export on the chat pairs."""
    return [f"recipe={recipe}", f"model.name_or_path={export}", f"data.train_files=[{pairs}]", "data.eval_files=[]",
            "data.eval_fraction=0", "data.max_seq_len=64", "trainer.max_steps=2",
            f"trainer.micro_batch_size={PAIR_MICRO}", "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=0",
            "trainer.log_every_n_steps=1"]


def ppo_args(export: Path, reward_hf: Path, prompts: Path) -> list[str]:
    return ["recipe=ppo_tiny", f"model.name_or_path={export}", "ppo.reward.function=null",
            f"ppo.reward.model={reward_hf}", "ppo.critic.init=reward", "data.format=messages",
            f"data.train_files=[{prompts}]", "data.eval_files=[]", "data.eval_fraction=0", "data.max_seq_len=64",
            "trainer.max_steps=1", "trainer.eval_every_n_steps=0", "ppo.rollout.prompts_per_step=16",
            "ppo.mini_batch_size=16", "ppo.epochs=1"]


def timed_jobs(jobs: dict[tuple[str, str], list[str]], roots: dict[str, Path], timings: dict) -> dict:
    """Each (fixture, stage) run into roots[fixture]/stage, two at a time; its wall clock into timings."""
    start = time.perf_counter()
    results = run_cli_jobs({key: {"args": [*args, f"output_dir={roots[key[0]] / key[1]}"], "timeout": 900}
                            for key, args in jobs.items()})
    for (name, stage), result in results.items():
        timings.setdefault(name, {})[stage] = round(result.seconds, 1)
    timings.setdefault("wall", []).append(round(time.perf_counter() - start, 1))
    return results


@pytest.fixture(scope="module")
def chains(tmp_path_factory, timings) -> dict:
    """Every run of the module, two at a time (one CPU core each): each fixture's SFT on chat messages, then from
    its export GRPO, a reward model and DPO, then PPO from that reward model (PPO_FIXTURES).
    -> {"roots": {fixture: folder}, "results": {(fixture, stage): result}}."""
    roots = {name: tmp_path_factory.mktemp(f"real_{name}") for name in MODEL_TYPES}
    for root in roots.values():
        as_messages(DATA / "reverse_train.jsonl", root / "train.jsonl", SFT_ROWS)
        as_messages(DATA / "reverse_eval.jsonl", root / "prompts.jsonl", PROMPTS)
        as_chat_pairs(DATA / "reverse_train.jsonl", root / "pairs.jsonl", PAIRS)
    results = timed_jobs({(name, "sft"): sft_args(fixture_model(name, MODEL_TYPES[name]), root / "train.jsonl")
                          for name, root in roots.items()}, roots, timings)
    exports = {name: root / "sft" / "hf" for name, root in roots.items() if results[name, "sft"].returncode == 0}
    jobs = {}
    for name, export in exports.items():
        root = roots[name]
        jobs[name, "grpo"] = grpo_args(export, root / "prompts.jsonl")
        jobs[name, "reward"] = pair_args("rm_tiny", export, root / "pairs.jsonl")
        jobs[name, "dpo"] = pair_args("dpo_tiny", export, root / "pairs.jsonl")
    results |= timed_jobs(jobs, roots, timings)
    results |= timed_jobs({(name, "ppo"): ppo_args(exports[name], roots[name] / "reward" / "hf",
                                                   roots[name] / "prompts.jsonl")
                           for name in PPO_FIXTURES if results.get((name, "reward")) is not None
                           and results[name, "reward"].returncode == 0}, roots, timings)
    return {"roots": roots, "results": results}


def result_of(chains: dict, name: str, stage: str):
    result = chains["results"].get((name, stage))
    assert result is not None, f"{name} {stage}: not run (an earlier stage of its chain failed)"
    assert_ok(result)
    return result


def trained(name: str, chains: dict, timings: dict) -> Trained:
    info = fixture_info(name)
    result_of(chains, name, "sft")
    root = chains["roots"][name]
    return Trained(name, root / "sft" / "hf", info["vocab_size"], info["tokens"]["end_of_turn"]["id"], root,
                   timings[name], chains)


@pytest.fixture(scope="module", params=list(MODEL_TYPES))
def sft(request, chains, timings) -> Trained:
    """One SFT run per fixture on chat messages, shared by the module's tests."""
    return trained(request.param, chains, timings)


@pytest.fixture(scope="module", params=PPO_FIXTURES)
def sft_for_ppo(request, chains, timings) -> Trained:
    """The fixtures whose chain goes on to PPO (SFT -> RM -> PPO)."""
    return trained(request.param, chains, timings)


def test_sft_on_messages_learns(sft):
    train, _ = read_metrics(sft.export.parent)
    # a random tiny model with tied embeddings starts near uniform over the real vocabulary
    assert abs(train[0]["loss"] - math.log(sft.vocab)) < 1.0, (train[0], sft.vocab)
    last = sum(r["loss"] for r in train[-5:]) / 5
    assert last < train[0]["loss"] - 3, [round(r["loss"], 2) for r in train]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"):
        assert (sft.export / name).is_file(), name


def test_grpo_from_the_export_stops_at_the_end_of_turn(sft):
    result, out = result_of(sft.chains, sft.name, "grpo"), sft.root / "grpo"
    assert sft.end_of_turn in stop_token_ids(result.stderr), result.stderr[-3000:]
    # the checkpoint's sampling defaults (generation_config.json) are named as overridden, not applied
    assert "not applied from" in result.stderr and "repetition_penalty=1.1" in result.stderr, result.stderr[-3000:]
    first = read_metrics(out)[0][0]
    sft.timings["eos_rate"] = first["eos_rate"]
    assert first["eos_rate"] > 0.9, first
    assert first["response_len"] < 16, first  # stopped, not cut at max_new_tokens
    assert first["samples"] == PROMPTS_PER_STEP * 4, first
    # one update per rollout: the update's forward is the old policy (the ratio 1 by construction, not logged); the
    # sampler's log-probs (KV-cached decode) against that forward
    assert "first_ratio_dev" not in first and first["mismatch_logp_abs_max"] < 1e-4, first


def test_chat_pairs_end_at_the_end_of_turn(sft):
    from transformers import AutoTokenizer

    from llmtrain.data.preference_format import encode_preference

    tokenizer = AutoTokenizer.from_pretrained(sft.export)
    pairs = as_chat_pairs(DATA / "reverse_train.jsonl", sft.root / "pairs.jsonl", PAIRS)
    pair = json.loads(pairs.read_text().splitlines()[0])
    encoded = encode_preference(pair, tokenizer, max_seq_len=64)
    for side in ("chosen", "rejected"):
        assert encoded[f"{side}_input_ids"][-1] == sft.end_of_turn, (side, encoded)
        assert encoded[f"{side}_labels"][-1] == sft.end_of_turn, (side, encoded)


@pytest.fixture(scope="module")
def reward_model(sft) -> Path:
    """Two steps of a reward model from the SFT export on chat pairs: its run folder."""
    result_of(sft.chains, sft.name, "reward")
    return sft.root / "reward"


def test_reward_model_from_the_export(reward_model):
    train, _ = read_metrics(reward_model)
    assert [r["step"] for r in train] == [1, 2], train
    first = train[0]
    assert first["pairs"] == PAIR_MICRO, first
    # a fresh, small score head: the two rewards of a pair nearly agree, so the loss is near ln 2
    assert abs(first["loss"] - math.log(2)) < 0.1 and 0.0 <= first["accuracy"] <= 1.0, first
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train), train
    # the stage's own pad token (the unk, or a new <|pad|>: Llama 3 and Qwen2.5 have no unk), not the eos
    config = json.loads((reward_model / "hf" / "config.json").read_text())
    assert config["pad_token_id"] is not None and config["pad_token_id"] != config["eos_token_id"], config


def test_ppo_with_the_reward_model(sft_for_ppo):
    """SFT -> RM -> PPO: the reward model (whose vocabulary may have grown by its pad token) scores the actor's
    replies at their end of turn, and the critic starts from it (ppo.critic.init=reward)."""
    sft = sft_for_ppo
    result_of(sft.chains, sft.name, "reward")
    result, out = result_of(sft.chains, sft.name, "ppo"), sft.root / "ppo"
    assert sft.end_of_turn in stop_token_ids(result.stderr), result.stderr[-3000:]
    first = read_metrics(out)[0][0]
    assert first["samples"] == 16 and first["eos_rate"] > 0.8, first
    assert first["first_ratio_dev"] == 0.0, first
    for key in ("score", "value_loss", "explained_var", "grad_norm"):
        assert math.isfinite(first[key]), (key, first)
    assert (out / "critic_hf" / "config.json").is_file()


def test_dpo_from_the_export(sft):
    result_of(sft.chains, sft.name, "dpo")
    train, _ = read_metrics(sft.root / "dpo")
    assert [r["step"] for r in train] == [1, 2], train
    first = train[0]
    # the policy is its reference at step 1
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5), first
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-5), first
    assert first["pairs"] == PAIR_MICRO, first
    assert first["logp_chosen"] < 0 and first["logp_rejected"] < 0, first
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train), train


def test_deepseek_messages_sft_is_refused(tmp_path, timings):
    """DeepSeek-V3's template renders the generation prompt with `<think>\\n` and a past answer without it: the
    prompt is not a prefix of the conversation, so the assistant tokens cannot be located."""
    model = fixture_model("deepseek", "llama")
    train = as_messages(DATA / "reverse_train.jsonl", tmp_path / "train.jsonl", 16)
    start = time.perf_counter()
    result = run_cli(["recipe=sft_tiny", f"model.name_or_path={model}", "model.from_config=null",
                      "model.tokenizer=null", "data.format=messages", f"data.train_files=[{train}]",
                      "data.eval_files=[]", "data.eval_fraction=0", "trainer.max_steps=1",
                      "trainer.micro_batch_size=4", "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=0",
                      f"output_dir={tmp_path / 'run'}"], timeout=300)
    timings["deepseek"] = {"sft_refused": round(time.perf_counter() - start, 1)}
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "data.format=messages: the chat template of model.tokenizer does not render turns incrementally" \
        in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # chat preference pairs likewise (the reply cannot be located after the generation prompt)
    from transformers import AutoTokenizer

    from llmtrain.data.errors import DataConfigError
    from llmtrain.data.preference_format import encode_preference

    pair = json.loads(as_chat_pairs(DATA / "reverse_train.jsonl", tmp_path / "pairs.jsonl", 4).read_text()
                      .splitlines()[0])
    with pytest.raises(DataConfigError, match="does not render the chosen conversation incrementally"):
        encode_preference(pair, AutoTokenizer.from_pretrained(model), max_seq_len=64)
