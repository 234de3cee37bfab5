"""`recipe=rm_tiny` and `recipe=dpo_tiny` as a user runs them (their base, `${base:sft_tiny}`, is built once into
the test cache): the thresholds the README states, the reward model's export, DPO's policy after training, and
notebooks/preference_dashboard.ipynb on both runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from nbclient.exceptions import CellExecutionError

from tests.e2e.notebooks import edited_copy, last_eval_edited, printed
from tests.e2e.notebooks import execute as run_notebook
from tests.helpers import REPO, read_metrics, run_recipes

pytestmark = pytest.mark.e2e

NOTEBOOK = REPO / "notebooks" / "preference_dashboard.ipynb"


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> dict:
    """The five preference recipes as a user runs them, two at a time (one CPU core each)."""
    return run_recipes(tmp_path_factory, ["rm_tiny", "dpo_tiny", "simpo_tiny", "orpo_tiny", "kto_tiny"])


@pytest.fixture(scope="module")
def rm_run(recipe_runs):
    return recipe_runs["rm_tiny"]


@pytest.fixture(scope="module")
def dpo_run(recipe_runs):
    return recipe_runs["dpo_tiny"]


def test_rm_tiny_separates_easy_negatives(rm_run):
    train, evals = read_metrics(rm_run)
    assert evals[0]["step"] == 0 and evals[-1]["step"] == train[-1]["step"]
    assert evals[-1]["eval_accuracy"] >= 0.95, evals[-1]
    assert 0 <= evals[-1]["eval_accuracy_hard"] <= 1  # reported, no threshold
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(r["pairs"] == 64 for r in train)


def test_exported_reward_model_scores_like_the_stage_in_transformers(rm_run):
    """AutoModelForSequenceClassification on the export, right-padded batch with its own pad token: transformers'
    pooled score equals the score at each EOS; the config carries the eval reward mean and std."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llmtrain.models.heads import sequence_scores

    tokenizer = AutoTokenizer.from_pretrained(rm_run / "hf")
    model = AutoModelForSequenceClassification.from_pretrained(rm_run / "hf", dtype=torch.float32).eval()
    config = json.loads((rm_run / "hf" / "config.json").read_text())
    assert config["pad_token_id"] == tokenizer.pad_token_id != tokenizer.eos_token_id
    last_eval = read_metrics(rm_run)[1][-1]
    assert (config["reward_mean"] == last_eval["eval_reward_mean"]
            and config["reward_std"] == last_eval["eval_reward_std"])
    texts = ["reverse: abc\ncba", "reverse: hello\nolleh", "reverse: hello\nhello"]
    rows = [[tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
            for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])  # (3, T)
    mask = (ids != tokenizer.pad_token_id).long()
    lengths = torch.tensor([len(r) for r in rows])
    with torch.no_grad():
        ours = sequence_scores(model, model, lengths - 1, input_ids=ids, attention_mask=mask)
        theirs = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert ours[1] > ours[2]  # the reversal beats the copy


def greedy_exact_match(model_dir, rows) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hits = 0
    for row in rows:
        ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(row["prompt"], add_special_tokens=False).input_ids]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.eos_token_id)
        hits += tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == row["response"]
    return hits / len(rows)


def test_dpo_tiny_prefers_the_reversal_and_keeps_the_policy(dpo_run):
    train, evals = read_metrics(dpo_run)
    assert evals[0]["step"] == 0 and abs(evals[0]["eval_loss"] - math.log(2)) < 1e-6
    assert evals[0]["eval_reward_accuracy"] == 0  # policy == reference: every implied reward is 0
    assert evals[-1]["eval_reward_accuracy"] >= 0.8, evals[-1]
    rows = [json.loads(line) for line in (REPO / "llmtrain/assets/data/reverse_eval.jsonl").read_text().splitlines()]
    base = yaml.safe_load((dpo_run / "config.yaml").read_text())["model"]["name_or_path"]  # the sft_tiny export
    before, after = greedy_exact_match(base, rows), greedy_exact_match(dpo_run / "hf", rows)
    print(f"greedy exact match on the 256 held-out reversals: {before:.3f} (sft_tiny) -> {after:.3f} (dpo_tiny)")
    assert after >= before - 0.1, (before, after)


@pytest.fixture(scope="module")
def simpo_run(recipe_runs):
    return recipe_runs["simpo_tiny"]


@pytest.fixture(scope="module")
def orpo_run(recipe_runs):
    return recipe_runs["orpo_tiny"]


@pytest.mark.parametrize("recipe", ["simpo_tiny", "orpo_tiny"])
def test_reference_free_recipes_prefer_the_reversal(recipe, request):
    """SimPO and ORPO from the sft_tiny base, no reference role: held-out reward accuracy >= 0.8 (the README's
    threshold), the eval loss went down, and ORPO's NLL is part of its loss."""
    run_dir = request.getfixturevalue(recipe.replace("_tiny", "_run"))
    train, evals = read_metrics(run_dir)
    assert evals[0]["step"] == 0 and evals[-1]["step"] == train[-1]["step"]
    assert evals[-1]["eval_reward_accuracy"] >= 0.8, evals[-1]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"], evals
    assert all(r["pairs"] == 16 for r in train)
    assert not (run_dir / "checkpoints" / f"step_{train[-1]['step']}" / "engines" / "reference").exists()
    if recipe == "orpo_tiny":
        assert all(0 < e["eval_nll_loss"] < e["eval_loss"] for e in evals)


def test_kto_tiny_prefers_the_reversal_on_held_out_pairs(recipe_runs):
    """KTO on the easy pairs unpaired: at step 0 the policy is its reference (every completion's loss 0.5, accuracy
    0); after training the chosen completion's β·(log π − log π_ref) beats the rejected one's in >= 0.8 of the 256
    held-out pairs (the README's threshold), and every step counts 32 completions."""
    train, evals = read_metrics(recipe_runs["kto_tiny"])
    assert evals[0]["step"] == 0 and abs(evals[0]["eval_loss"] - 0.5) < 1e-6
    assert evals[0]["eval_reward_accuracy"] == 0 and evals[-1]["eval_pairs"] == 256
    assert evals[-1]["eval_reward_accuracy"] >= 0.8, evals[-1]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(r["completions"] == 32 for r in train)


@pytest.mark.parametrize("recipe", ["rm_tiny", "dpo_tiny", "simpo_tiny", "orpo_tiny"])
def test_preference_dashboard_rescores_every_held_out_pair(recipe, kernel_name, monkeypatch, request):
    """notebooks/preference_dashboard.ipynb on each run: the exported model scores every held-out pair again (the
    RM at the EOS in transformers; DPO's β·(log π − log π_ref) against the base; SimPO's and ORPO's β·log π averaged
    over the response) and the accuracy and mean margin it prints (and asserts) are the run's last evaluation;
    accuracy and margin by kind of pair; a figure file."""
    run_dir = request.getfixturevalue({"rm_tiny": "rm_run"}.get(recipe, recipe.replace("_tiny", "_run")))
    last = read_metrics(run_dir)[1][-1]
    accuracy, margin = (("eval_accuracy", "eval_margin") if recipe == "rm_tiny" else
                        ("eval_reward_accuracy", "eval_reward_margin"))
    nb = run_notebook(NOTEBOOK, run_dir, kernel_name, monkeypatch)
    text = printed(nb)
    assert (f"matches the run's evaluation at step {last['step']}: accuracy {last[accuracy]:.4f}, "
            f"mean margin {last[margin]:.4f}") in text, text
    summary = " ".join(printed(nb, "summary").split())
    assert f"{last['eval_pairs']} held-out pairs" in summary, summary
    if recipe == "rm_tiny":
        assert f"hard: 256 pairs, accuracy {last['eval_accuracy_hard']:.4f}" in summary, summary
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (run_dir / "preference_dashboard.png").stat().st_size > 0


def test_preference_dashboard_fails_when_the_export_is_not_what_the_run_evaluated(dpo_run, kernel_name, monkeypatch,
                                                                                  tmp_path):
    last = read_metrics(dpo_run)[1][-1]
    drifted = last_eval_edited(eval_reward_accuracy=last["eval_reward_accuracy"] / 2)
    broken = edited_copy(dpo_run, tmp_path / "drifted", drifted)
    with pytest.raises(CellExecutionError) as error:
        run_notebook(NOTEBOOK, broken, kernel_name, monkeypatch)
    assert error.value.ename == "AssertionError" and "recomputed accuracy" in error.value.evalue
