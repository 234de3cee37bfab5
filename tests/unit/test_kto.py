"""KTO: its losses by hand, then TRL 1.16's KTOTrainer on the same batch; the unpaired data it trains on."""

import copy
import math

import pytest
import torch

from llmtrain.losses.dpo import sequence_logps
from llmtrain.losses.kto import (
    KTO_STATS,
    kl_reference_point,
    kto_loss_terms,
    kto_metrics,
    kto_stat_sums,
    mismatched_kl_sum,
)
from llmtrain.losses.lm import IGNORE_INDEX

POLICY, REFERENCE = torch.tensor([-3.0, -5.0, -2.0, -4.0]), torch.tensor([-3.5, -4.0, -2.5, -3.0])
DESIRABLE = torch.tensor([True, False, True, False])


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_by_hand():
    beta, kl, dw, uw = 0.5, 0.2, 1.5, 0.7
    terms = kto_loss_terms(POLICY, REFERENCE, DESIRABLE, torch.tensor(kl), beta=beta, loss_type="kto",
                           desirable_weight=dw, undesirable_weight=uw)
    ratios = (POLICY - REFERENCE).tolist()
    expected = [dw * (1 - sigmoid(beta * (r - kl))) if d else uw * (1 - sigmoid(beta * (kl - r)))
                for r, d in zip(ratios, DESIRABLE.tolist())]
    assert terms.losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert terms.rewards.tolist() == pytest.approx([beta * r for r in ratios], rel=1e-6)


def test_apo_zero_unpaired_by_hand_ignores_the_reference_point():
    beta = 0.3
    with_kl, without = (kto_loss_terms(POLICY, REFERENCE, DESIRABLE, torch.tensor(kl), beta=beta,
                                       loss_type="apo_zero_unpaired") for kl in (5.0, 0.0))
    ratios = (POLICY - REFERENCE).tolist()
    expected = [1 - sigmoid(beta * r) if d else sigmoid(beta * r) for r, d in zip(ratios, DESIRABLE.tolist())]
    assert with_kl.losses.tolist() == pytest.approx(expected, rel=1e-6) == without.losses.tolist()


def test_reference_point_is_the_clamped_mean_and_detached():
    policy_kl = torch.tensor([-1.0, -2.0, 0.5], requires_grad=True)
    counted = torch.tensor([1.0, 1.0, 0.0])  # the third is a filler
    total = mismatched_kl_sum(policy_kl, torch.tensor([-1.5, -1.0, 9.0]), counted)
    assert total.item() == pytest.approx(-0.5) and not total.requires_grad
    assert kl_reference_point(total, 2).item() == 0.0  # clamped at 0
    assert kl_reference_point(torch.tensor(0.9), 2).item() == pytest.approx(0.45)
    assert kl_reference_point(0.0, 0).item() == 0.0  # an empty batch: 0, never NaN


def test_gradient_reaches_the_policy_only_through_the_completions():
    policy = POLICY.clone().requires_grad_(True)
    kl = torch.tensor(0.3, requires_grad=True)
    terms = kto_loss_terms(policy, REFERENCE, DESIRABLE, kl, beta=0.1, loss_type="kto")
    terms.losses.sum().backward()
    assert policy.grad is not None and kl.grad is None and not terms.rewards.requires_grad
    assert (policy.grad[DESIRABLE] < 0).all() and (policy.grad[~DESIRABLE] > 0).all()  # up for good, down for bad


def test_unknown_loss_type_is_refused():
    with pytest.raises(ValueError, match="kto.loss_type='sigmoid'"):
        kto_loss_terms(POLICY, REFERENCE, DESIRABLE, torch.tensor(0.0), beta=0.1, loss_type="sigmoid")


# --- against TRL 1.16's KTOTrainer on one batch, one rank -----------------------------------------

UNPAIRED_ROWS = {
    "prompt": ["2+2=", "The sky is", "Say hi:", "Name a fruit:"],
    "completion": [" 4", " green", " hi", " a rock, obviously"],
    "label": [True, False, True, False],
}


@pytest.fixture(scope="module")
def policy_and_reference(tokenizer, tiny_llama):
    """A tiny causal LM and, as its reference, a copy whose weights were nudged: the log-ratios are not 0, and the
    nudged (sharper) reference gives the mismatched completions lower log-probs, so the KL estimate z0 is above 0
    (the other way round it is clamped to 0 and the test would not see it)."""
    policy = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        bos_token_id=tokenizer.bos_token_id)  # after torch.manual_seed(0)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return policy, reference


def trl_kto(tokenizer, policy, reference, tmp_path, **config):
    """TRL's KTO loss, its logged metrics and its collated batch (KL sequences included) for one batch."""
    trl = pytest.importorskip("trl", reason="TRL is the reference implementation; install the dev extra")
    from datasets import Dataset

    rows = len(UNPAIRED_ROWS["prompt"])
    args = trl.KTOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                         per_device_train_batch_size=rows, train_sampling_strategy="sequential", **config)
    trainer = trl.KTOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                             train_dataset=Dataset.from_dict(UNPAIRED_ROWS), processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(rows)])
    loss = trainer.compute_loss(trainer.model, batch)
    return loss.item(), {name: values[-1] for name, values in trainer._metrics["train"].items()}, batch


def our_kto(policy, reference, batch, *, beta, loss_type, desirable_weight=1.0, undesirable_weight=1.0):
    """Our loss from plain forwards of the same models on TRL's sequences (completions, then the KL ones)."""
    def logps(model, prefix):
        ids, mask = batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"]
        labels = ids.masked_fill(batch[f"{prefix}completion_mask"] == 0, IGNORE_INDEX)  # (N, T)
        with torch.no_grad():
            return sequence_logps(model(ids, attention_mask=mask).logits, labels)  # (N,)

    desirable = batch["label"].bool()
    counted = torch.ones(len(desirable))
    kl = torch.zeros(())  # apo_zero_unpaired: TRL builds no KL sequences
    if "KL_input_ids" in batch:
        kl = kl_reference_point(mismatched_kl_sum(logps(policy, "KL_"), logps(reference, "KL_"), counted),
                                len(desirable))
    policy_logps = logps(policy, "")
    terms = kto_loss_terms(policy_logps, logps(reference, ""), desirable, kl, beta=beta, loss_type=loss_type,
                           desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    metrics = kto_metrics(dict(zip(KTO_STATS, kto_stat_sums(terms, policy_logps, desirable, counted).tolist())))
    return terms.losses.sum().item() / len(desirable), {**metrics, "kl": kl.item()}


@pytest.mark.parametrize("loss_type, weights", [("kto", (1.0, 1.0)), ("kto", (1.3, 0.6)),
                                                ("apo_zero_unpaired", (1.0, 1.0))])
def test_kto_matches_trl(tokenizer, policy_and_reference, tmp_path, loss_type, weights):
    policy, reference = policy_and_reference
    config = dict(beta=0.5, loss_type=loss_type, desirable_weight=weights[0], undesirable_weight=weights[1])
    trl_loss, trl_metrics, batch = trl_kto(tokenizer, policy, reference, tmp_path, **config)
    loss, metrics = our_kto(policy, reference, batch, **config)
    if loss_type == "kto":
        assert trl_metrics["kl"] > 1e-3, "the KL reference point must not be clamped to 0 for this test to mean much"
    print(f"KTO {loss_type} {weights}: ours {loss:.9f} TRL {trl_loss:.9f} |diff| {abs(loss - trl_loss):.2e}")
    assert abs(loss - trl_loss) <= 1e-6, (loss, trl_loss)
    names = {"reward_chosen": "rewards/chosen", "reward_rejected": "rewards/rejected",
             "logp_chosen": "logps/chosen", "logp_rejected": "logps/rejected", "reward_margin": "rewards/margins"}
    if loss_type == "kto":
        names["kl"] = "kl"
    for ours, theirs in names.items():
        assert abs(metrics[ours] - trl_metrics[theirs]) <= 1e-5 * max(1.0, abs(trl_metrics[theirs])), ours
