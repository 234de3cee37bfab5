"""`recipe=lora_sft_tiny` as a user runs it: LoRA adapters on the tiny pretrained base (`${base:pretrain_tiny}`, which
has not learned reversal) learn the reversal task (the thresholds the README states), and both exports reproduce the
adapted model."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.helpers import assert_ok, read_metrics, run_cli_jobs

pytestmark = pytest.mark.e2e


SHORT = ["peft=lora", "trainer.max_steps=3", "trainer.eval_every_n_steps=3", "trainer.eval_batch_size=64"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The recipe as a user runs it, beside 3 steps of rm_tiny and of dpo_tiny with peft=lora (two at a time, one
    CPU core each): {name: (run folder, result)}."""
    root = tmp_path_factory.mktemp("lora_recipes")
    jobs = {"lora_sft_tiny": [], "rm_tiny": SHORT, "dpo_tiny": SHORT}
    results = run_cli_jobs({name: {"args": [f"recipe={name}", *extra, f"output_dir={root / name}"], "timeout": 1200}
                            for name, extra in jobs.items()})
    for result in results.values():
        assert_ok(result)
    return {name: (root / name, results[name]) for name in jobs}


@pytest.fixture(scope="module")
def lora_run(runs):
    return runs["lora_sft_tiny"][0]


def test_lora_sft_tiny_learns(lora_run):
    """Measured: eval loss 7.02 -> 1.94, accuracy 0.016 -> 0.498 (greedy exact match 0 -> 0.02 on the 256 held-out
    reversals); 77,824 trainable parameters = Σ r·(d_in + d_out), r 16, 14 matrices."""
    train, evals = read_metrics(lora_run)
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 500
    assert evals[0]["eval_accuracy"] < 0.05  # the base has not learned the task
    assert evals[-1]["eval_loss"] <= evals[0]["eval_loss"] - 4.0, (evals[0], evals[-1])
    assert evals[-1]["eval_accuracy"] >= evals[0]["eval_accuracy"] + 0.4
    checkpoint = lora_run / "checkpoints" / "step_500" / "engines" / "policy" / "model.pt"
    state = torch.load(checkpoint, weights_only=True)
    assert sum(t.numel() for t in state.values()) == 77_824


def test_merged_export_equals_the_adapted_model(lora_run):
    """The base (the pretrain_tiny export the run names) + adapter/ = the adapted model; hf/ (merged) gives its logits
    to 1e-4."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = yaml.safe_load((lora_run / "config.yaml").read_text())["model"]["name_or_path"]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa")
    adapted = PeftModel.from_pretrained(base, lora_run / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(lora_run / "hf", dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    ids = torch.tensor([tokenizer("reverse: hello\nolleh").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-4)


def test_reward_and_dpo_take_lora(runs):
    """peft=lora on the pair stages (3 steps each from ${base:sft_tiny}): the reward model trains its new score
    head in full next to the adapters and exports a sequence classifier; DPO's reference is the policy with its
    adapters disabled, so step 1's loss is ln 2 (B = 0: policy = reference)."""
    import math

    from transformers import AutoModelForSequenceClassification

    (rm, result), (dpo, dpo_result) = runs["rm_tiny"], runs["dpo_tiny"]
    assert "Σ r·(d_in + d_out) over 14 adapted matrices = 38912, modules_to_save 128" in result.stderr
    assert "39040 trainable parameters" in result.stderr
    AutoModelForSequenceClassification.from_pretrained(rm / "hf", dtype=torch.float32)
    assert (rm / "adapter" / "adapter_config.json").is_file()
    assert "reference: the policy with adapters disabled (no second copy of the base)" in dpo_result.stderr
    first = read_metrics(dpo)[0][0]
    assert abs(first["loss"] - math.log(2)) < 1e-6 and first["reward_margin"] == 0
