"""Reward-model and DPO losses: hand computations, then TRL 1.16's trainers on the same batch."""

import copy
import math
from pathlib import Path

import pytest
import torch

from llmtrain.losses.dpo import (
    AVERAGED_LOGPS,
    DPO_STATS,
    dpo_loss_terms,
    dpo_metrics,
    dpo_stat_sums,
    sequence_logps,
)
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.losses.pairwise import PAIRWISE_STATS, pairwise_loss_sum, pairwise_metrics, pairwise_stat_sums
from tests import helpers

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "llmtrain" / "assets" / "tokenizer"
LN2 = math.log(2)


def neg_logsigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def close(actual, expected, rel=1e-6, abs_=1e-7) -> bool:
    return math.isclose(float(actual), expected, rel_tol=rel, abs_tol=abs_)


def named(sums: torch.Tensor, names: tuple[str, ...]) -> dict[str, float]:
    return dict(zip(names, sums.tolist(), strict=True))


# --- reward model: hand computations -----------------------------------------------------------

CHOSEN, REJECTED = [1.0, 0.5, -0.2], [0.0, 1.5, -0.2]


def test_pairwise_loss_matches_hand_computation():
    chosen, rejected = torch.tensor(CHOSEN), torch.tensor(REJECTED)
    expected = neg_logsigmoid(1.0) + neg_logsigmoid(-1.0) + neg_logsigmoid(0.0)
    assert close(pairwise_loss_sum(chosen, rejected), expected)


def test_pairwise_loss_with_margin_and_centring():
    chosen, rejected = torch.tensor(CHOSEN), torch.tensor(REJECTED)
    margin = torch.tensor([0.5, 0.0, 2.0])
    expected = neg_logsigmoid(1.0 - 0.5) + neg_logsigmoid(-1.0) + neg_logsigmoid(-2.0)
    assert close(pairwise_loss_sum(chosen, rejected, margin=margin), expected)
    centring = 0.1 * ((1.0 + 0.0) ** 2 + (0.5 + 1.5) ** 2 + (-0.4) ** 2)
    assert close(pairwise_loss_sum(chosen, rejected, margin=margin, center_coef=0.1), expected + centring)
    # a scalar margin applies to every pair
    assert close(pairwise_loss_sum(chosen, rejected, margin=1.0),
                 neg_logsigmoid(0.0) + neg_logsigmoid(-2.0) + neg_logsigmoid(-1.0))


def test_pairwise_loss_is_fp32_and_differentiable_from_bf16():
    chosen = torch.tensor(CHOSEN, dtype=torch.bfloat16, requires_grad=True)
    loss = pairwise_loss_sum(chosen, torch.tensor(REJECTED, dtype=torch.bfloat16))
    loss.backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    # d/dr_c of -logsigmoid(r_c - r_r) is -sigmoid(r_r - r_c)
    expected = [-1 / (1 + math.exp(c - r)) for c, r in zip(CHOSEN, REJECTED, strict=True)]
    assert torch.allclose(chosen.grad.float(), torch.tensor(expected), atol=1e-2)


def test_equal_rewards_cost_ln2_per_pair_and_count_as_wrong():
    rewards = torch.full((4,), 0.7)
    assert close(pairwise_loss_sum(rewards, rewards.clone()), 4 * LN2)
    metrics = pairwise_metrics(named(pairwise_stat_sums(rewards, rewards.clone()), PAIRWISE_STATS), 4)
    assert metrics["accuracy"] == 0.0 and metrics["margin"] == 0.0
    assert close(metrics["reward_std"], 0.0, abs_=1e-6)


def test_pairwise_stats_and_metrics_by_hand():
    chosen = torch.tensor(CHOSEN, requires_grad=True)
    sums = pairwise_stat_sums(chosen, torch.tensor(REJECTED))
    assert sums.shape == (len(PAIRWISE_STATS),) and not sums.requires_grad
    by_name = named(sums, PAIRWISE_STATS)
    assert by_name["correct"] == 1.0  # 1 > 0 only; 0.5 < 1.5 and the tie -0.2 = -0.2 are wrong
    assert close(by_name["margin"], 1.0 - 1.0 + 0.0)
    assert close(by_name["reward_chosen"], 1.3) and close(by_name["reward_rejected"], 1.3)
    rewards = CHOSEN + REJECTED
    assert close(by_name["reward_sq"], sum(r * r for r in rewards))
    assert close(by_name["reward_sum"], sum(rewards))

    metrics = pairwise_metrics(by_name, num_pairs=3)
    mean = sum(rewards) / 6
    population_std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 6)
    assert close(metrics["accuracy"], 1 / 3) and close(metrics["margin"], 0.0)
    assert close(metrics["reward_chosen"], 1.3 / 3) and close(metrics["reward_rejected"], 1.3 / 3)
    assert close(metrics["reward_std"], population_std)


def test_metrics_from_two_micro_batches_equal_one_batch():
    generator = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(6, generator=generator), torch.randn(6, generator=generator)
    whole = pairwise_metrics(named(pairwise_stat_sums(chosen, rejected), PAIRWISE_STATS), 6)
    summed = pairwise_stat_sums(chosen[:2], rejected[:2]) + pairwise_stat_sums(chosen[2:], rejected[2:])
    split = pairwise_metrics(named(summed, PAIRWISE_STATS), 6)
    assert whole.keys() == split.keys()
    assert all(close(split[key], whole[key]) for key in whole)
    assert close(whole["reward_std"], torch.cat([chosen, rejected]).std(unbiased=False).item(), rel=1e-5)


# --- DPO: hand computations --------------------------------------------------------------------

# (policy_chosen, policy_rejected, ref_chosen, ref_rejected) per pair, and x = (π_c − π_r) − (ref_c − ref_r)
LOGPS = ([-4.0, -10.0], [-6.0, -9.0], [-5.0, -11.0], [-5.5, -8.0])
X = [(-4.0 + 6.0) - (-5.0 + 5.5), (-10.0 + 9.0) - (-11.0 + 8.0)]  # [1.5, 2.0]


def dpo_terms(loss_type: str, beta: float = 0.1, label_smoothing: float = 0.0):
    return dpo_loss_terms(*(torch.tensor(values) for values in LOGPS), beta=beta, loss_type=loss_type,
                          label_smoothing=label_smoothing)


def test_dpo_sigmoid_by_hand():
    terms = dpo_terms("sigmoid", beta=0.1)
    assert all(close(loss, neg_logsigmoid(0.1 * x)) for loss, x in zip(terms.losses, X, strict=True))
    assert torch.allclose(terms.chosen_rewards, torch.tensor([0.1 * (-4.0 + 5.0), 0.1 * (-10.0 + 11.0)]))
    assert torch.allclose(terms.rejected_rewards, torch.tensor([0.1 * (-6.0 + 5.5), 0.1 * (-9.0 + 8.0)]))


def test_cdpo_label_smoothing_by_hand():
    terms = dpo_terms("sigmoid", beta=0.5, label_smoothing=0.1)
    expected = [0.9 * neg_logsigmoid(0.5 * x) + 0.1 * neg_logsigmoid(-0.5 * x) for x in X]
    assert all(close(loss, e) for loss, e in zip(terms.losses, expected, strict=True))


def test_ipo_by_hand():
    terms = dpo_terms("ipo", beta=0.25)
    assert all(close(loss, (x - 1 / (2 * 0.25)) ** 2) for loss, x in zip(terms.losses, X, strict=True))
    assert "ipo" in AVERAGED_LOGPS and "sigmoid" not in AVERAGED_LOGPS


def test_policy_equal_to_reference_gives_ln2_and_zero_rewards():
    logps = torch.tensor([-3.25, -17.5, -0.125])
    terms = dpo_loss_terms(logps, logps.flip(0), logps.clone(), logps.flip(0).clone(), beta=0.1,
                           loss_type="sigmoid")
    assert torch.equal(terms.losses, torch.full((3,), LN2))
    assert torch.equal(terms.chosen_rewards, torch.zeros(3)) and torch.equal(terms.rejected_rewards, torch.zeros(3))
    metrics = dpo_metrics(named(dpo_stat_sums(terms, logps, logps.flip(0)), DPO_STATS), 3)
    assert metrics["reward_accuracy"] == 0.0  # ties are wrong


def test_dpo_gradient_flows_to_policy_only_and_rewards_are_detached():
    policy = torch.tensor(LOGPS[0], requires_grad=True)
    reference = torch.tensor(LOGPS[2], requires_grad=True)
    terms = dpo_loss_terms(policy, torch.tensor(LOGPS[1]), reference, torch.tensor(LOGPS[3]), beta=0.1,
                           loss_type="sigmoid")
    assert not terms.chosen_rewards.requires_grad and not terms.rejected_rewards.requires_grad
    terms.losses.sum().backward()
    # d/dπ_c of -logsigmoid(βx) is -β·sigmoid(-βx)
    expected = [-0.1 / (1 + math.exp(0.1 * x)) for x in X]
    assert torch.allclose(policy.grad, torch.tensor(expected))


def test_unknown_loss_and_ignored_smoothing_are_refused():
    with pytest.raises(ValueError, match=r"dpo\.loss='kto'.*\['apo_down', 'apo_zero', 'bco_pair', 'hinge'"):
        dpo_terms("kto")
    with pytest.raises(ValueError, match=r"dpo\.label_smoothing=0\.5 must be < 0\.5"):
        dpo_terms("robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"dpo\.label_smoothing"):
        dpo_terms("ipo", label_smoothing=0.1)


def test_dpo_stats_and_metrics_by_hand():
    terms = dpo_terms("sigmoid", beta=0.1)
    sums = dpo_stat_sums(terms, torch.tensor(LOGPS[0]), torch.tensor(LOGPS[1]))
    assert sums.shape == (len(DPO_STATS),)
    chosen_rewards, rejected_rewards = [0.1, 0.1], [-0.05, -0.1]
    metrics = dpo_metrics(named(sums, DPO_STATS), num_pairs=2)
    assert metrics.keys() == {"reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected",
                              "logp_chosen", "logp_rejected"}
    assert metrics["reward_accuracy"] == 1.0
    assert close(metrics["reward_margin"], (0.15 + 0.2) / 2, rel=1e-5)
    assert close(metrics["reward_chosen"], sum(chosen_rewards) / 2, rel=1e-5)
    assert close(metrics["reward_rejected"], sum(rejected_rewards) / 2, rel=1e-5)
    assert close(metrics["logp_chosen"], -7.0) and close(metrics["logp_rejected"], -7.5)


# --- sequence_logps against a loop over positions ----------------------------------------------

def test_sequence_logps_matches_a_loop_over_positions():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 7, generator=generator)  # (B, T, V)
    labels = torch.randint(0, 7, (3, 6), generator=generator)
    labels[0, :2] = IGNORE_INDEX  # prompt
    labels[1, 4:] = IGNORE_INDEX  # padding
    labels[2, 1:] = IGNORE_INDEX  # no target at all (label 0 is never a target)
    expected_sum, expected_mean = [], []
    for row in range(3):
        terms = [torch.log_softmax(logits[row, t], dim=-1)[labels[row, t + 1]].item()
                 for t in range(5) if labels[row, t + 1] != IGNORE_INDEX]
        expected_sum.append(math.fsum(terms))
        expected_mean.append(math.fsum(terms) / len(terms) if terms else 0.0)
    assert torch.allclose(sequence_logps(logits, labels), torch.tensor(expected_sum), atol=1e-5)
    assert torch.allclose(sequence_logps(logits, labels, average=True), torch.tensor(expected_mean), atol=1e-5)
    assert sequence_logps(logits, labels)[2].item() == 0.0


def test_sequence_logps_is_fp32_from_bf16_logits():
    logits = torch.randn(2, 4, 5).to(torch.bfloat16)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, 3], [IGNORE_INDEX, IGNORE_INDEX, 4, IGNORE_INDEX]])
    logps = sequence_logps(logits, labels)
    assert logps.dtype == torch.float32
    assert torch.allclose(logps, sequence_logps(logits.float(), labels))


# --- against TRL 1.16 on the same batch with a tiny Llama --------------------------------------

PREFERENCE_ROWS = {
    "prompt": ["2+2=", "The sky is", "Say hi:"],
    "chosen": [" 4", " blue today", " hi"],
    "rejected": [" five", " green", " no thanks, bye"],
}


def tiny_llama_config(tokenizer, **extra):
    return helpers.tiny_llama_config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **extra)


@pytest.fixture(scope="module")
def policy_and_reference(tokenizer):
    """A tiny causal LM and a copy whose weights were nudged, so the DPO loss is not ln 2."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_llama_config(tokenizer))
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return policy, reference


def trl_dpo(tokenizer, policy, reference, tmp_path, rows=None, **config):
    """TRL's DPO loss, its logged metrics and the collated batch, for one batch of `rows`."""
    trl = pytest.importorskip("trl", reason="TRL is the reference implementation; install the dev extra")
    from datasets import Dataset

    rows = rows or PREFERENCE_ROWS
    num_pairs = len(rows["prompt"])
    # bf16=False: transformers' TrainingArguments default to bf16, and TRL then wraps the reference forward in
    # autocast; our forwards are fp32.
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                         per_device_train_batch_size=num_pairs, **config)
    trainer = trl.DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                             train_dataset=Dataset.from_dict(rows), processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(num_pairs)])
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.item(), metrics, batch


def our_dpo(policy, reference, batch, *, beta, loss_type, label_smoothing=0.0):
    """Our loss from plain forwards of the same models: labels are input_ids outside the completions masked."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)  # (2P, T)
    average = loss_type in AVERAGED_LOGPS
    with torch.no_grad():
        policy_logps = sequence_logps(policy(batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                      labels, average=average)  # (2P,)
        reference_logps = sequence_logps(reference(batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                         labels, average=average)  # (2P,)
    policy_chosen, policy_rejected = policy_logps.chunk(2)  # the batch is [chosen rows; rejected rows]
    terms = dpo_loss_terms(policy_chosen, policy_rejected, *reference_logps.chunk(2), beta=beta,
                           loss_type=loss_type, label_smoothing=label_smoothing)
    sums = dpo_stat_sums(terms, policy_chosen, policy_rejected)
    num_pairs = len(terms.losses)
    return terms.losses.sum().item() / num_pairs, dpo_metrics(named(sums, DPO_STATS), num_pairs)


def test_dpo_sigmoid_matches_trl(tokenizer, policy_and_reference, tmp_path):
    policy, reference = policy_and_reference
    trl_loss, trl_metrics, batch = trl_dpo(tokenizer, policy, reference, tmp_path, beta=0.1, loss_type="sigmoid")
    loss, metrics = our_dpo(policy, reference, batch, beta=0.1, loss_type="sigmoid")
    assert abs(trl_loss - LN2) > 1e-3, "the policy must differ from the reference for this test to mean anything"
    assert math.isclose(loss, trl_loss, rel_tol=1e-5)
    trl_names = {"reward_accuracy": "rewards/accuracies", "reward_margin": "rewards/margins",
                 "reward_chosen": "rewards/chosen", "reward_rejected": "rewards/rejected",
                 "logp_chosen": "logps/chosen", "logp_rejected": "logps/rejected"}
    for ours, theirs in trl_names.items():
        assert math.isclose(metrics[ours], trl_metrics[theirs], rel_tol=1e-5, abs_tol=1e-6), ours


def test_dpo_ipo_matches_trl_with_averaged_logps(tokenizer, policy_and_reference, tmp_path):
    policy, reference = policy_and_reference
    trl_loss, _, batch = trl_dpo(tokenizer, policy, reference, tmp_path, beta=0.1, loss_type="ipo")
    loss, _ = our_dpo(policy, reference, batch, beta=0.1, loss_type="ipo")
    assert math.isclose(loss, trl_loss, rel_tol=1e-5)


@pytest.mark.parametrize("loss_type, label_smoothing", [("hinge", 0.0), ("robust", 0.2), ("bco_pair", 0.0),
                                                        ("sppo_hard", 0.0), ("nca_pair", 0.0), ("apo_zero", 0.0),
                                                        ("apo_down", 0.0)])
def test_trl_pairwise_losses_match_trl(tokenizer, policy_and_reference, tmp_path, loss_type, label_smoothing):
    """TRL's other pairwise losses (dpo.loss=...), each against TRL 1.16's DPOTrainer on the same batch."""
    policy, reference = policy_and_reference
    trl_loss, _, batch = trl_dpo(tokenizer, policy, reference, tmp_path, beta=0.5, loss_type=loss_type,
                                 label_smoothing=label_smoothing)
    loss, _ = our_dpo(policy, reference, batch, beta=0.5, loss_type=loss_type, label_smoothing=label_smoothing)
    assert math.isclose(loss, trl_loss, rel_tol=1e-5)


def test_cdpo_matches_trl_aot_on_one_pair(tokenizer, policy_and_reference, tmp_path):
    """TRL 1.16's "sigmoid" ignores label_smoothing; its "aot" loss is cDPO after sorting the batch's
    log-ratios, and sorting one pair changes nothing."""
    policy, reference = policy_and_reference
    one_pair = {key: values[1:2] for key, values in PREFERENCE_ROWS.items()}
    trl_loss, _, batch = trl_dpo(tokenizer, policy, reference, tmp_path, rows=one_pair, beta=0.5, loss_type="aot",
                                 label_smoothing=0.1)
    loss, _ = our_dpo(policy, reference, batch, beta=0.5, loss_type="sigmoid", label_smoothing=0.1)
    assert math.isclose(loss, trl_loss, rel_tol=1e-5)


def test_reward_model_loss_matches_trl(tokenizer, tmp_path):
    trl = pytest.importorskip("trl", reason="TRL is the reference implementation; install the dev extra")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_llama_config(tokenizer, num_labels=1))
    rows = dict(PREFERENCE_ROWS, margin=[0.5, 0.0, 1.0])
    args = trl.RewardConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                            per_device_train_batch_size=3, center_rewards_coefficient=0.01)
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=Dataset.from_dict(rows),
                                processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    trl_loss = trainer.compute_loss(trainer.model, dict(batch)).item()
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    # Score every position, then pick the one TRL's model pools at: the rightmost token that is not
    # the pad token. With pad = eos that is the last completion token *before* the appended eos.
    with torch.no_grad():
        hidden = model.model(batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        scores = model.score(hidden).squeeze(-1)  # (2P, T)
    positions = torch.arange(batch["input_ids"].size(1))
    pooled_at = (positions * (batch["input_ids"] != tokenizer.pad_token_id)).argmax(dim=-1)  # (2P,)
    rewards = scores[torch.arange(len(scores)), pooled_at]  # (2P,)
    r_chosen, r_rejected = rewards.chunk(2)  # the batch is [chosen rows; rejected rows]

    loss = pairwise_loss_sum(r_chosen, r_rejected, margin=batch["margin"], center_coef=0.01).item() / 3
    assert math.isclose(loss, trl_loss, rel_tol=1e-5)
    metrics = pairwise_metrics(named(pairwise_stat_sums(r_chosen, r_rejected), PAIRWISE_STATS), 3)
    assert math.isclose(metrics["accuracy"], trl_metrics["accuracy"])
    assert math.isclose(metrics["margin"], trl_metrics["margin"], rel_tol=1e-5, abs_tol=1e-7)
