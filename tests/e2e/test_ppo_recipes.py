"""ppo_tiny, grpo_tiny, rloo_tiny and dapo_tiny as a user runs them (one run each, read by several tests): the score
rises while the KL stays small, held-out greedy exact match improves, the first ratio is exactly 1 every iteration; a
user's reward function by `module:attribute`; a reward model directory as the frozen reward role and the critic's
start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import TOKENIZER_DIR, JsonServer, assert_ok, cli_env, read_metrics, run_cli_jobs, run_recipes

pytestmark = pytest.mark.e2e

WINDOW = 10
PPO_KEYS = ("score", "score_std", "reward", "kl", "kl_token", "kl_coef", "policy_loss", "value_loss", "clip_frac",
            "approx_kl", "entropy", "explained_var", "response_len", "first_ratio_dev", "time_rollout_s",
            "time_experience_s", "time_update_s", "generation_share")


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> dict[str, Path]:
    """The four recipes as a user runs them, two at a time (one CPU core each)."""
    return run_recipes(tmp_path_factory, ["ppo_tiny", "grpo_tiny", "rloo_tiny", "dapo_tiny"])


@pytest.fixture(scope="module")
def ppo_run(recipe_runs) -> Path:
    return recipe_runs["ppo_tiny"]


@pytest.fixture(scope="module")
def grpo_run(recipe_runs) -> Path:
    return recipe_runs["grpo_tiny"]


@pytest.fixture(scope="module")
def rloo_run(recipe_runs) -> Path:
    return recipe_runs["rloo_tiny"]


@pytest.fixture(scope="module")
def dapo_run(recipe_runs) -> Path:
    return recipe_runs["dapo_tiny"]


def windowed(train: list[dict], key: str) -> tuple[float, float]:
    """(mean of the first 10 iterations, mean of the last 10)."""
    first, last = train[:WINDOW], train[-WINDOW:]
    return sum(r[key] for r in first) / len(first), sum(r[key] for r in last) / len(last)


@pytest.mark.parametrize("run_name", ["ppo_run", "grpo_run", "rloo_run", "dapo_run"])
def test_score_rises_while_kl_stays_small(run_name, request):
    train, evals = read_metrics(request.getfixturevalue(run_name))
    before, after = windowed(train, "score")
    assert after - before >= 0.03, (before, after)
    assert max(r["kl"] for r in train) < 1.0
    assert evals[-1]["eval_exact_match"] > evals[0]["eval_exact_match"]  # held-out, greedy
    assert [r["first_ratio_dev"] for r in train] == [0.0] * len(train)


def test_ppo_logs_every_key_and_exports_actor_and_critic(ppo_run):
    train, evals = read_metrics(ppo_run)
    assert all(key in train[0] for key in PPO_KEYS)
    assert {"eval_score", "eval_exact_match"} <= set(evals[0])
    assert 0 < train[-1]["generation_share"] < 1
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(ppo_run / "critic_hf").num_labels == 1
    assert (ppo_run / "hf" / "config.json").is_file()


def test_grpo_has_no_critic_and_keeps_the_kl_in_the_loss(grpo_run):
    train, _ = read_metrics(grpo_run)
    assert "value_loss" not in train[0] and "kl_loss" in train[0]
    assert not (grpo_run / "critic_hf").exists()
    engines = grpo_run / "checkpoints" / "step_80" / "engines"
    assert sorted(p.name for p in engines.iterdir()) == ["actor", "reference"]


SHORT = ["trainer.max_steps=2", "trainer.eval_every_n_steps=0", "trainer.save_every_n_steps=0",
         "ppo.rollout.prompts_per_step=8", "ppo.mini_batch_size=8", "ppo.epochs=1", "trainer.micro_batch_size=8",
         "ppo.rollout.max_new_tokens=8", "data.eval_files=[]"]
USER_REWARDS = """
import json

def score(prompts, responses, response):
    with open({calls!r}, "a") as f:
        f.write(json.dumps({{"prompts": prompts, "responses": responses, "response": response}}) + "\\n")
    return [float(len(r)) for r in responses]
"""


def tiny_reward_model(tmp_path: Path) -> Path:
    """A random tiny reward model directory with exported reward statistics (mean 0.5, std 2)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                                  pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    reward_dir = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)
    exported = json.loads((reward_dir / "config.json").read_text())
    (reward_dir / "config.json").write_text(json.dumps({**exported, "reward_mean": 0.5, "reward_std": 2.0}))
    return reward_dir


@pytest.fixture(scope="module")
def short(tmp_path_factory) -> Path:
    """The 2-iteration runs of the tests below, two at a time (one CPU core each): {name}/ in the returned folder;
    the user's reward module and the random reward model beside them."""
    root = tmp_path_factory.mktemp("ppo_short")
    (root / "my_rewards.py").write_text(USER_REWARDS.format(calls=str(root / "calls.jsonl")))
    reward_dir = tiny_reward_model(root)
    server = reversal_server()
    runs = {"user_fn": ["recipe=ppo_tiny", "ppo.reward.function=my_rewards:score"],
            "rm_dir": ["recipe=ppo_tiny", "ppo.reward.function=null", f"ppo.reward.model={reward_dir}",
                       "ppo.reward.normalize=true", "ppo.critic.init=reward"],
            "rm_and_fn": ["recipe=ppo_tiny", f"ppo.reward.model={reward_dir}", "ppo.reward.model_weight=0.5"],
            "critic_warmup": ["recipe=ppo_tiny", "ppo.critic.warmup_steps=1"],
            "lora": ["recipe=ppo_tiny", "peft=lora", "peft.r=4"],
            "beta_zero": ["recipe=grpo_tiny", "ppo.kl.coef=0"],
            "beta_adaptive": ["recipe=grpo_tiny", "trainer.max_steps=3", "ppo.kl.coef=0.05", "ppo.kl.target=1e-6",
                              "ppo.kl.horizon=160", "optim.lr=1e-3"],
            # the reversal reward from a server at weight -1 beside the same function at +1
            "server": ["recipe=grpo_tiny", f"ppo.reward.url={server.url}", "ppo.reward.url_weight=-1",
                       "ppo.reward.url_batch_size=5"]}
    # only the user's module needs its folder on the path (the others start from the tests' forkserver)
    user_env = cli_env(PYTHONPATH=f"{root}:{Path(__file__).resolve().parents[2]}")
    try:
        results = run_cli_jobs({name: {"args": [args[0], *SHORT, *args[1:], f"output_dir={root / name}"],
                                       "env": user_env if name == "user_fn" else cli_env()}
                                for name, args in runs.items()})
    finally:
        server.close()
    (root / "server_requests.json").write_text(json.dumps(server.requests))
    for result in results.values():
        assert_ok(result)
    return root


def reversal_server() -> JsonServer:
    """A reward server scoring with the reversal task's function (ppo.reward.url)."""
    from llmtrain.rewards.reversal import score

    return JsonServer(lambda body: (200, {"rewards": score(body["prompts"], body["responses"], **body["columns"])}))


def test_a_reward_server_scores_as_the_function_it_serves(short):
    """ppo.reward.url (OpenRLHF's remote reward model) serving the reversal function, weighted -1 beside the function
    at +1: on the same responses its mean equals the function's and every sample's total is exactly 0; each rank
    posted its 16 responses in batches of 5 with the query text as the model saw it."""
    train, _ = read_metrics(short / "server")
    assert len(train) == 2
    for r in train:
        assert r["score_remote"] == r["score_fn_score"] and r["score"] == 0.0 and r["score_std"] == 0.0
    from llmtrain.rewards.reversal import target_of

    requests = json.loads((short / "server_requests.json").read_text())
    assert [len(q["responses"]) for q in requests] == ([5] * 6 + [2]) * 2  # 8 prompts × 4 samples a step
    for q in requests:
        assert q["labels"] == [target_of(prompt) for prompt in q["prompts"]]  # the reference column, as labels
        assert all(prompt.strip() in query for prompt, query in zip(q["prompts"], q["query"]))


def test_a_user_reward_function_by_module_and_attribute_gets_the_columns(short):
    calls = [json.loads(line) for line in (short / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2 and all(len(c["prompts"]) == 8 == len(c["response"]) for c in calls)
    assert calls[0]["prompts"][0].startswith("reverse: ")  # the raw prompt column, not the templated ids
    train, _ = read_metrics(short / "user_fn")
    lengths = [sum(len(r) for r in c["responses"]) / 8 for c in calls]
    assert [r["score"] for r in train] == pytest.approx(lengths)


def test_a_reward_model_directory_scores_and_starts_the_critic(short):
    train, _ = read_metrics(short / "rm_dir")
    assert len(train) == 2 and all(abs(r["score"]) < 10 for r in train)
    engines = short / "rm_dir" / "checkpoints" / "step_2" / "engines"
    assert sorted(p.name for p in engines.iterdir()) == ["actor", "critic", "reference", "reward"]
    assert json.loads((engines / "reward" / "frozen.json").read_text())["source"] == str(short / "rm")


def test_a_reward_model_and_a_reward_function_score_together(short):
    """ppo.reward.model beside ppo.reward.function (issue 21): each sample's score is the function's plus
    model_weight × the model's; each source's global mean is logged (score_fn_score, score_rm)."""
    train, _ = read_metrics(short / "rm_and_fn")
    assert len(train) == 2 and all(r["score_rm"] != 0 for r in train)
    for r in train:
        assert r["score"] == pytest.approx(r["score_fn_score"] + 0.5 * r["score_rm"], rel=1e-5, abs=1e-6)


def test_critic_warmup_trains_the_critic_alone_first(short):
    """ppo.critic.warmup_steps=1: iteration 1 updates only the critic, so iteration 2 still samples from the
    unchanged actor (its KL to the reference is exactly 0), then both learn (issue 21)."""
    first, second = read_metrics(short / "critic_warmup")[0]
    assert first["actor_frozen"] == 1.0 and "policy_loss" not in first and first["value_loss"] > 0
    assert second["kl"] == 0.0 and "actor_frozen" not in second and second["first_ratio_dev"] == 0.0


def test_lora_actor_takes_its_reference_from_the_adapters_switched_off(short):
    """peft=lora: the reference is the actor with its adapters disabled (no second copy of the base): at the first
    iteration the KL is exactly 0 and the first ratio exactly 1; only the adapters train."""
    out = short / "lora"
    train, _ = read_metrics(out)
    assert train[0]["kl"] == 0.0 and [r["first_ratio_dev"] for r in train] == [0.0, 0.0]
    reference = json.loads((out / "checkpoints" / "step_2" / "engines" / "reference" / "frozen.json").read_text())
    assert reference.get("adapter_off_of") == "actor"
    assert (out / "adapter").is_dir() and (out / "critic_hf").is_dir()


def test_grpo_at_beta_zero_builds_no_reference_and_an_adaptive_beta_moves(short):
    """β = 0 (fixed): no reference role is built, saved or run, and the KL is 0 (TRL builds none either). An adaptive
    β with the KL as a loss term starts at ppo.kl.coef and moves with the KL the update measures (it started at 0 and
    stayed there)."""
    free, adaptive = short / "beta_zero", short / "beta_adaptive"
    train, _ = read_metrics(free)
    assert [r["kl"] for r in train] == [0.0, 0.0] and all("kl_loss" not in r for r in train)
    assert sorted(p.name for p in (free / "checkpoints" / "step_2" / "engines").iterdir()) == ["actor"]
    train, _ = read_metrics(adaptive)
    # step 1's update starts at the reference (KL 0 < target: β × 0.96 for 32 samples); then it moved (KL > target)
    assert train[0]["kl_coef"] == 0.05 and train[0]["kl"] == 0 and train[1]["kl"] > 1e-6
    assert train[1]["kl_coef"] == pytest.approx(0.05 * 0.96)
    assert train[2]["kl_coef"] == pytest.approx(0.05 * 0.96 * 1.04)
