"""PPO / GRPO maths: hand computations written out, naive loops, then TRL 1.16's GRPO loss on one batch."""

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import llmtrain.losses.advantages as advantages_module
from llmtrain.losses.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    gae,
    group_advantages,
    masked_mean,
    masked_sum,
    needs_critic,
    token_rewards,
    whiten,
)
from llmtrain.losses.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, build_kl_controller
from llmtrain.losses.ppo import (
    action_logits,
    action_logps,
    entropy_from_logits,
    explained_variance,
    policy_loss_terms,
    value_clip_frac,
    value_clipped,
    value_loss_terms,
)

NAN = float("nan")


def assert_close(actual, expected, atol=1e-6, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol)


# --- GAE ----------------------------------------------------------------------------------------

GAMMA, LAM = 0.9, 0.95  # γλ = 0.855


def gae_by_loop(rewards, values, mask, gamma, lam):
    """Naive per-row loop over the valid prefix, in float64 Python numbers."""
    advantages = [[0.0] * len(row) for row in rewards]
    for b, (r, v, m) in enumerate(zip(rewards, values, mask)):
        n = sum(m)
        running = 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            running = r[t] + gamma * next_value - v[t] + gamma * lam * running
            advantages[b][t] = running
    return advantages


def test_gae_by_hand_with_an_early_end_and_an_empty_row():
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.0, 2.0, 5.0], [NAN, NAN, NAN]])
    values = torch.tensor([[0.5, 0.4, 0.3], [1.0, 0.5, 9.0], [NAN, 1.0, 2.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    adv, ret = gae(rewards, values, mask, GAMMA, LAM)
    # row 0: δ2 = 1.0 − 0.3 = 0.7; δ1 = −0.2 + 0.9·0.3 − 0.4 = −0.33; δ0 = 0.1 + 0.9·0.4 − 0.5 = −0.04
    #        A2 = 0.7; A1 = −0.33 + 0.855·0.7 = 0.2685; A0 = −0.04 + 0.855·0.2685 = 0.1895675
    # row 1: the masked V2 = 9 is not bootstrapped: δ1 = 2.0 − 0.5 = 1.5; δ0 = 0 + 0.9·0.5 − 1.0 = −0.55
    #        A1 = 1.5; A0 = −0.55 + 0.855·1.5 = 0.7325
    # row 2: nothing valid, NaN garbage included -> zeros
    assert_close(adv, [[0.1895675, 0.2685, 0.7], [0.7325, 1.5, 0.0], [0.0, 0.0, 0.0]])
    assert_close(ret, [[0.6895675, 0.6685, 1.0], [1.7325, 2.0, 0.0], [0.0, 0.0, 0.0]])
    assert adv.dtype == ret.dtype == torch.float32


def test_gae_matches_a_loop_and_returns_are_advantages_plus_values():
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    lengths = [6, 3, 1, 0]
    mask = torch.arange(6) < torch.tensor(lengths).unsqueeze(1)  # (4, 6)
    adv, ret = gae(rewards.bfloat16(), values.bfloat16(), mask, 0.99, 0.9)
    r, v = rewards.bfloat16().double().tolist(), values.bfloat16().double().tolist()
    assert_close(adv, gae_by_loop(r, v, mask.tolist(), 0.99, 0.9), atol=1e-5)
    assert_close(ret, torch.where(mask, adv + values.bfloat16().float(), 0.0), atol=0)


# --- whitening ----------------------------------------------------------------------------------

WHITEN_VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
WHITEN_MASK = torch.tensor([[True, True, True], [True, False, False]])


def test_whiten_by_hand():
    # valid: 1, 2, 3, 4 -> mean 2.5, biased var (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    out = whiten(WHITEN_VALUES, WHITEN_MASK)
    s = math.sqrt(1.25 + 1e-8)
    assert_close(out, [[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]])
    valid = out[WHITEN_MASK]
    assert_close(valid.mean(), 0.0)
    assert_close(valid.var(unbiased=False), 1.0, atol=1e-6)
    x = WHITEN_VALUES[WHITEN_MASK]
    assert_close(valid, (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-8))
    kept = whiten(WHITEN_VALUES, WHITEN_MASK, shift_mean=False)
    assert_close(kept, [[-1.5 / s + 2.5, -0.5 / s + 2.5, 0.5 / s + 2.5], [1.5 / s + 2.5, 0.0, 0.0]])


def test_whiten_of_nothing_is_zero():
    out = whiten(WHITEN_VALUES, torch.zeros_like(WHITEN_MASK))
    assert torch.equal(out, torch.zeros_like(out))


def test_whiten_uses_the_global_batch(monkeypatch):
    """Two fake ranks: each whitens its half with the other's sums added, as all_reduce would."""
    halves = [(WHITEN_VALUES[:1], WHITEN_MASK[:1]), (WHITEN_VALUES[1:], WHITEN_MASK[1:]),
              (WHITEN_VALUES[1:], torch.zeros_like(WHITEN_MASK[1:]))]  # the last rank holds no valid token
    local = []
    monkeypatch.setattr(advantages_module, "all_reduce_sum", lambda t, group=None: local.append(t.clone()) or t)
    for values, mask in halves:
        whiten(values, mask)
    assert len(local) == 3, "every rank joins the reduce, even one without a valid token"
    total = sum(local)
    monkeypatch.setattr(advantages_module, "all_reduce_sum", lambda t, group=None: t.copy_(total))
    out = torch.cat([whiten(values, mask) for values, mask in halves[:2]])
    monkeypatch.undo()
    assert_close(out, whiten(WHITEN_VALUES, WHITEN_MASK))


# --- KL -----------------------------------------------------------------------------------------

def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert_close(KL_ESTIMATORS["k1"](logp, ref), [[0.5, -1.0]])
    assert_close(KL_ESTIMATORS["k2"](logp, ref), [[0.125, 0.5]])
    # x = ref − logp = (−0.5, 1.0): e^x − x − 1
    assert_close(KL_ESTIMATORS["k3"](logp, ref), [[math.exp(-0.5) + 0.5 - 1, math.e - 2]])


def test_k3_is_nonnegative_and_finite_for_a_diverged_policy():
    torch.manual_seed(0)
    logp, ref = torch.randn(64, 32) * 3, torch.randn(64, 32) * 3
    assert (KL_ESTIMATORS["k3"](logp, ref) >= 0).all()
    far = KL_ESTIMATORS["k3"](torch.tensor([[-1000.0, 0.0]]), torch.tensor([[0.0, -1000.0]]))
    assert torch.isfinite(far).all()
    assert_close(far, [[10.0, 10.0]])  # e^20 − 21 and e^−20 + 19 past the log-ratio clamp, then the estimate's (verl)


def test_adaptive_kl_controller_by_hand_and_resume():
    controller = AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    controller.update(9.0, 256)  # error = clip(9/6 − 1 = 0.5) = 0.2;   × (1 + 0.2·256/10000) = 1.00512
    assert math.isclose(controller.value, 0.2 * 1.00512, rel_tol=1e-15)
    controller.update(3.0, 512)  # error = clip(3/6 − 1 = −0.5) = −0.2; × (1 − 0.2·512/10000) = 0.98976
    assert math.isclose(controller.value, 0.2 * 1.00512 * 0.98976, rel_tol=1e-15)
    controller.update(6.6, 100)  # error = 0.1 (inside the clip);      × (1 + 0.1·100/10000) = 1.001
    assert math.isclose(controller.value, 0.2 * 1.00512 * 0.98976 * 1.001, rel_tol=1e-15)
    resumed = build_kl_controller(0.2, target=6.0, horizon=10000)
    resumed.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert resumed.value == controller.value  # bitwise
    for kl in (7.0, 1.0):
        controller.update(kl, 64)
        resumed.update(kl, 64)
    assert resumed.value == controller.value


def test_fixed_kl_controller():
    controller = build_kl_controller(0.05, target=None, horizon=10000)
    assert isinstance(controller, FixedKLController)
    controller.update(100.0, 512)
    assert controller.value == 0.05
    controller.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    with pytest.raises(ValueError, match="cannot change on resume"):
        controller.load_state_dict({"value": 0.1})


# --- policy and value losses --------------------------------------------------------------------

def test_policy_loss_clips_both_sides_by_hand():
    eps = 0.2
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 3.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -2.0]])
    logp = (old + ratios.log()).requires_grad_()
    terms = policy_loss_terms(logp, old, adv, mask, eps)
    # max(−Aρ, −A·clip(ρ)):
    #   A=+1, ρ=1.5: max(−1.5, −1.2) = −1.2 clipped  | A=−1, ρ=0.5: max(0.5, 0.8) = 0.8 clipped
    #   A=+2, ρ=1.1: −2.2 in range                   | A=+1, ρ=0.5: max(−0.5, −0.8) = −0.5 not clipped
    #   A=−1, ρ=1.5: max(1.5, 1.2) = 1.5 not clipped | masked: 0
    assert_close(terms.losses, [[-1.2, 0.8, -2.2], [-0.5, 1.5, 0.0]])
    assert terms.clipped.tolist() == [[True, True, False], [False, False, False]]
    assert_close(terms.ratio, torch.where(mask, ratios, 3.0))
    assert_close(terms.approx_kl, torch.where(mask, 0.5 * ratios.log() ** 2, 0.0))
    masked_sum(terms.losses, mask).backward()
    # a clipped token has no gradient; elsewhere d(−Aρ)/dlogp = −Aρ
    assert_close(logp.grad, [[0.0, 0.0, -2.2], [-0.5, 1.5, 0.0]])


def test_first_ratio_is_exactly_one(tiny_llama):
    """The old log-probs from the experience's forward (eval mode, no grad) and the update's (train mode, with grad,
    through the fused head) of the same weights are bitwise equal, so the first ratio is exactly 1 and the loss −A."""

    from llmtrain.models.fused_head import install
    from llmtrain.stages.head import action_answer
    from llmtrain.stages.ppo.rollout import model_inputs

    model = tiny_llama(attn_implementation="sdpa", vocab_size=64, hidden_size=32, intermediate_size=64)
    install(model, chunk_tokens=5)
    sequences = torch.randint(1, 64, (3, 10))
    attention = torch.ones_like(sequences)
    attention[0, :3] = 0  # a left-padded prompt
    inputs = model_inputs(sequences, attention)
    with torch.no_grad():
        old = action_answer(model.eval(), inputs, sequences, 4, temperature=0.7).logps
    logp = action_answer(model.train(), inputs, sequences, 4, temperature=0.7).logps
    adv, mask = torch.randn(3, 4), torch.ones(3, 4, dtype=torch.bool)
    terms = policy_loss_terms(logp, old, adv, mask, 0.2)
    assert torch.equal(terms.ratio, torch.ones(3, 4))
    assert torch.equal(terms.losses, -adv)
    assert not terms.clipped.any() and torch.equal(terms.approx_kl, torch.zeros(3, 4))


def test_policy_loss_stays_finite_for_a_diverged_policy():
    terms = policy_loss_terms(torch.tensor([[0.0]]), torch.tensor([[-1000.0]]), torch.tensor([[-1.0]]),
                              torch.tensor([[True]]), 0.2)
    assert_close(terms.ratio, [[math.exp(20)]], rtol=1e-6)
    assert torch.isfinite(terms.losses).all()


VALUES = torch.tensor([[1.5, 0.5, 1.5], [1.1, 7.0, 0.0]])
OLD_VALUES = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
RETURNS = torch.tensor([[2.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
VALUE_MASK = torch.tensor([[True, True, True], [True, False, False]])


def test_value_loss_clips_both_sides_by_hand():
    # ε = 0.2: V_clipped = V_old + clip(V − V_old, ±0.2)
    #   V=1.5 ↑, R=2: max((−0.5)², (1.2−2)²=0.64) -> 0.32 clipped | V=0.5 ↓, R=0: max(0.25, 0.8²) -> 0.32 clipped
    #   V=1.5, R=1: max(0.25, 0.2²) -> 0.125, clip not taken       | V=1.1 in range, R=2: 0.5·0.81 = 0.405
    losses = value_loss_terms(VALUES, OLD_VALUES, RETURNS, VALUE_MASK, clip_eps=0.2)
    assert_close(losses, [[0.32, 0.32, 0.125], [0.405, 0.0, 0.0]])
    assert value_clipped(VALUES, OLD_VALUES, RETURNS, VALUE_MASK, 0.2).tolist() == [[True, True, False],
                                                                                    [False, False, False]]
    assert_close(value_clip_frac(VALUES, OLD_VALUES, RETURNS, VALUE_MASK, 0.2), 0.5)
    unclipped = value_loss_terms(VALUES, OLD_VALUES, RETURNS, VALUE_MASK, clip_eps=None)
    assert_close(unclipped, [[0.125, 0.125, 0.125], [0.405, 0.0, 0.0]])
    assert_close(value_clip_frac(VALUES, OLD_VALUES, RETURNS, VALUE_MASK, None), 0.0)


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # R = 1, 2, 3, 4: Var 1.25; R − V with V = R + (0, 0, 0, 1): 0, 0, 0, −1, Var = 0.25 − 0.0625 = 0.1875
    values = returns + torch.tensor([[0.0, 0.0, 0.0], [1.0, 9.0, 9.0]])
    assert_close(explained_variance(values, returns, mask), 1 - 0.1875 / 1.25)
    assert_close(explained_variance(returns, returns, mask), 1.0)
    assert torch.isnan(explained_variance(values, torch.ones(2, 3), mask))


# --- GRPO advantages, token rewards, the registry -----------------------------------------------

def test_group_advantages_by_hand():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 5.0, 5.0, 5.0])
    # group [1, 2, 3]: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    # group [4, 0, 0]: mean 4/3, deviations (8/3, −4/3, −4/3), unbiased var (64 + 16 + 16)/9/2 = 16/3
    # group [5, 5, 5]: std 0 -> 0 / 1e-4 = 0
    std = 4 / math.sqrt(3)
    expected = [-1 / 1.0001, 0.0, 1 / 1.0001, (8 / 3) / (std + 1e-4), (-4 / 3) / (std + 1e-4),
                (-4 / 3) / (std + 1e-4), 0.0, 0.0, 0.0]
    assert_close(group_advantages(scores, 3), expected)


def test_group_of_one_gives_zero_and_bad_sizes_are_refused():
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(4), 3)


def test_group_advantages_match_trl_formula():
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="TRL is the reference implementation")
    torch.manual_seed(0)
    scores = torch.randn(12)
    grouped = scores.view(-1, 4)
    # TRL 1.16 GRPOTrainer, scale_rewards="group": (r − nanmean) / (nanstd + 1e-4)
    trl = (grouped - grouped.nanmean(dim=1, keepdim=True)) / (trl_utils.nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    assert_close(group_advantages(scores, 4), trl.view(-1))


def test_token_rewards_put_the_score_on_the_last_action_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False], [True, False, False]])
    rewards = token_rewards(kl, torch.tensor([1.0, 2.0, 3.0, 4.0]), mask, kl_coef=0.1)
    assert_close(rewards, [[-0.01, -0.02, 0.97], [-0.05, 1.95, 0.0], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0]])


def test_estimator_registry():
    assert set(needs_critic) == set(ADVANTAGE_ESTIMATORS)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    inputs = AdvantageInputs(token_rewards=torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, -1.0]]),
                             values=torch.tensor([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]), mask=mask,
                             scores=torch.tensor([1.0, -1.0]), group_size=2, gamma=1.0, lam=1.0)
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](inputs)
    # γ = λ = 1: A_t = Σ_{k≥t} r_k − V_t;  row 0: (1 − 0.5, 1 − 0.5), row 1: (−1, −1, −1)
    assert_close(adv, [[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]])
    assert_close(ret, [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    adv, ret = ADVANTAGE_ESTIMATORS["grpo"](inputs)
    a = 1 / (math.sqrt(2) + 1e-4)  # group [1, −1]: mean 0, unbiased std √2
    assert ret is None
    assert_close(adv, [[a, a, 0.0], [-a, -a, -a]])
    with pytest.raises(ValueError, match="values=None"):
        ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(**{**inputs.__dict__, "values": None}))


def test_masked_helpers_ignore_what_is_masked():
    x = torch.tensor([[1.0, NAN], [3.0, math.inf]])
    mask = torch.tensor([[True, False], [True, False]])
    assert_close(masked_sum(x, mask), 4.0)
    assert_close(masked_mean(x, mask, dim=0), [2.0, 0.0])


# --- log-probs and entropy ----------------------------------------------------------------------

def test_action_logps_equal_log_softmax_gather():
    torch.manual_seed(0)
    logits, sequences = torch.randn(2, 6, 11) * 3, torch.randint(0, 11, (2, 6))
    for temperature in (1.0, 0.7):
        expected = torch.zeros(2, 3, dtype=torch.float64)
        for b in range(2):
            for a, t in enumerate(range(3, 6)):  # the last 3 tokens, each predicted by position t − 1
                expected[b, a] = torch.log_softmax(logits[b, t - 1].double() / temperature, -1)[sequences[b, t]]
        logps = action_logps(logits, sequences, 3, temperature)
        assert logps.dtype == torch.float32 and logps.shape == (2, 3)
        assert_close(logps, expected, atol=1e-6)
    assert action_logps(logits.bfloat16(), sequences, 3).dtype == torch.float32
    with pytest.raises(ValueError, match="num_actions=0"):
        action_logits(logits, 0)


def test_entropy_equals_minus_sum_p_log_p():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11) * 3
    sliced = action_logits(logits, 3)
    assert torch.equal(sliced, logits[:, 2:5])
    for temperature in (1.0, 0.7):
        p = torch.softmax(sliced.double() / temperature, -1)
        assert_close(entropy_from_logits(sliced, temperature), -(p * p.log()).sum(-1), atol=1e-5)


# --- TRL 1.16 GRPO loss on one batch ------------------------------------------------------------
# TRL's GRPOTrainer._compute_loss is called unbound on a stand-in with the attributes it reads; the
# model forward is replaced by fixed per-token log-probs, so only the loss maths is compared.

def trl_grpo_loss(logp, old_logp, ref_logp, advantages, mask, *, loss_type, beta, bias_correction, eps=0.2,
                  eps_high=None, level="token", trl_loss=None):
    grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is the reference implementation")
    batch = logp.size(0)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
        beta=beta, loss_type=loss_type, epsilon_low=eps, epsilon_high=eps if eps_high is None else eps_high,
        use_vllm=False, max_completion_length=mask.size(1),
        args=SimpleNamespace(use_bias_correction_kl=bias_correction, delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                    gather_for_metrics=lambda x: x),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(batch, 2, dtype=torch.long), "prompt_mask": torch.ones(batch, 2),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": old_logp, "ref_per_token_logps": ref_logp,
              "num_items_in_batch": mask.sum()}
    loss = grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    if trl_loss is not None:
        trl_loss.append(loss)
    return loss.item(), {name: values[-1] for name, values in trainer._metrics["train"].items()}


@pytest.fixture
def grpo_batch():
    torch.manual_seed(0)
    mask = torch.tensor([[True] * 6, [True, True, False, False, False, False], [True] * 4 + [False] * 2])
    old = -torch.rand(3, 6) * 3
    logp = old + torch.randn(3, 6) * 0.3  # ratios spread across both clip edges
    ref = old + torch.randn(3, 6) * 0.3
    return logp, old, ref, torch.tensor([1.2, -0.7, 0.4]), mask


def ours(logp, old, ref, advantages, mask, beta):
    terms = policy_loss_terms(logp, old, advantages.unsqueeze(1).expand_as(mask), mask, 0.2)
    return terms, terms.losses + beta * torch.where(mask, KL_ESTIMATORS["k3"](logp, ref), 0.0)


def test_clipped_loss_plus_k3_token_mean_equals_trl_dapo(grpo_batch):
    """llmtrain's KL term has no importance-sampling correction: TRL's use_bias_correction_kl=False."""
    logp, old, ref, advantages, mask = grpo_batch
    trl_loss, trl_metrics = trl_grpo_loss(logp, old, ref, advantages, mask, loss_type="dapo", beta=0.04,
                                          bias_correction=False)
    terms, per_token = ours(logp, old, ref, advantages, mask, 0.04)
    assert terms.clipped.any() and not terms.clipped[mask].all(), "both clipped and unclipped tokens"
    assert math.isclose((masked_sum(per_token, mask) / mask.sum()).item(), trl_loss, rel_tol=1e-6)
    assert math.isclose(masked_mean(terms.clipped.float(), mask).item(), trl_metrics["clip_ratio/region_mean"])
    kl = masked_mean(KL_ESTIMATORS["k3"](logp, ref), mask)
    assert math.isclose(kl.item(), trl_metrics["kl"], rel_tol=1e-6)


def test_trl_grpo_loss_type_is_a_mean_of_sequence_means(grpo_batch):
    """Documents TRL's loss_type="grpo": not our token mean when lengths differ."""
    logp, old, ref, advantages, mask = grpo_batch
    trl_loss, _ = trl_grpo_loss(logp, old, ref, advantages, mask, loss_type="grpo", beta=0.04, bias_correction=False)
    _, per_token = ours(logp, old, ref, advantages, mask, 0.04)
    assert math.isclose(masked_mean(per_token, mask, dim=1).mean().item(), trl_loss, rel_tol=1e-6)
    assert not math.isclose((masked_sum(per_token, mask) / mask.sum()).item(), trl_loss, rel_tol=1e-3)



# TRL's loss types are llmtrain's loss aggregations (ppo.loss_agg); TRL's importance_sampling_level="sequence" is
# GSPO (ppo.ratio=sequence); epsilon_high is clip-higher (ppo.clip_eps_high)
TRL_LOSS_TYPES = {"dapo": "token_mean", "grpo": "seq_mean_token_mean", "luspo": "seq_mean_token_sum",
                  "dr_grpo": "dr_grpo"}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", list(TRL_LOSS_TYPES))
def test_loss_aggregation_ratio_level_and_clip_higher_equal_trl(grpo_batch, loss_type, level):
    """The loss and its gradient w.r.t. every log-prob equal TRL 1.16's GRPOTrainer._compute_loss on one batch (k3 KL,
    ε_low 0.2, ε_high 0.28); with level=sequence our per-token GSPO ratio (GSPO-token) has TRL's sequence ratio's
    value and, with one advantage per sequence, its gradient."""
    from llmtrain.losses.ppo import aggregation_weights

    logp, old, ref, advantages, mask = grpo_batch
    logp = logp.clone().requires_grad_()
    trl_losses = []
    trl_grpo_loss(logp, old, ref, advantages, mask, loss_type=loss_type, beta=0.04, bias_correction=False,
                  eps_high=0.28, level=level, trl_loss=trl_losses)
    terms = policy_loss_terms(logp, old, advantages.unsqueeze(1).expand_as(mask), mask, 0.2, clip_eps_high=0.28,
                              ratio_level=level)
    if level == "token":
        assert terms.clipped.any() and (terms.ratio[mask] > 1.2).any(), "the batch reaches both clip edges' region"
    per_token = terms.losses + 0.04 * torch.where(mask, KL_ESTIMATORS["k3"](logp, ref), 0.0)
    weights, count = aggregation_weights(mask, TRL_LOSS_TYPES[loss_type], max_new_tokens=mask.size(1))
    loss = (per_token * weights).sum() / count
    assert math.isclose(loss.item(), trl_losses[0].item(), rel_tol=1e-6)
    ours_grad, = torch.autograd.grad(loss, logp)
    theirs_grad, = torch.autograd.grad(trl_losses[0], logp)
    assert_close(ours_grad, theirs_grad, rtol=1e-5, atol=1e-7)


def test_dual_clip_caps_the_loss_of_a_negative_advantage_by_hand():
    """ρ = e² ≈ 7.39 on a token with A = −1: clipped PPO gives max(7.39, 1.2) = 7.39; dual-clip with c = 3 caps it at
    3 (no gradient then); a positive advantage is untouched."""
    logp, old = torch.tensor([[2.0, 2.0]]), torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    advantages = torch.tensor([[-1.0, 1.0]])
    plain = policy_loss_terms(logp, old, advantages, mask, 0.2).losses
    dual = policy_loss_terms(logp, old, advantages, mask, 0.2, clip_ratio_c=3.0).losses
    assert_close(plain, torch.tensor([[math.exp(2.0), -1.2]]))
    assert_close(dual, torch.tensor([[3.0, -1.2]]))


# --- the advantage estimators of issue 21, by hand ---------------------------------------------------------------

def estimator_inputs(scores, kl_coef=0.0, gamma=1.0, group_size=2, scale="group"):
    from llmtrain.losses.advantages import AdvantageInputs, token_rewards

    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False], [True, True, True]])
    kl = torch.full((4, 3), 0.5)
    rewards = token_rewards(kl, scores, mask, kl_coef)
    return AdvantageInputs(token_rewards=rewards, values=None, mask=mask, scores=scores, group_size=group_size,
                           gamma=gamma, lam=1.0, scale_rewards=scale), mask


def test_rloo_is_the_return_minus_the_mean_of_the_others():
    """Groups (1, 3) and (4, 8): 1 − 3 = −2, 3 − 1 = 2, 4 − 8 = −4, 8 − 4 = 4 on every action token; with K = 4 the
    baseline is the mean of the three others; with the KL in the reward the returns are score − β·ΣKL."""
    inputs, mask = estimator_inputs(torch.tensor([1.0, 3.0, 4.0, 8.0]))
    advantages, returns = ADVANTAGE_ESTIMATORS["rloo"](inputs)
    assert returns is None
    assert_close(advantages, torch.where(mask, torch.tensor([-2.0, 2.0, -4.0, 4.0]).unsqueeze(1), 0.0))
    four, _ = estimator_inputs(torch.tensor([1.0, 3.0, 4.0, 8.0]), group_size=4)
    expected = torch.tensor([1 - 15 / 3, 3 - 13 / 3, 4 - 12 / 3, 8 - 8 / 3])
    assert_close(ADVANTAGE_ESTIMATORS["rloo"](four)[0][:, 0], expected)
    penalised, _ = estimator_inputs(torch.tensor([1.0, 3.0, 4.0, 8.0]), kl_coef=1.0)  # KL 0.5 per token
    returns = torch.tensor([1 - 1.5, 3 - 1.0, 4 - 0.5, 8 - 1.5])
    assert_close(ADVANTAGE_ESTIMATORS["rloo"](penalised)[0][:, 0],
                 torch.stack([returns[0] - returns[1], returns[1] - returns[0], returns[2] - returns[3],
                              returns[3] - returns[2]]))


def test_reinforce_pp_returns_to_go_with_and_without_the_group_baseline():
    """Row 0: rewards (−0.25, −0.25, 1 − 0.25) with β·KL = 0.25 per token; γ = 0.5: G = (−0.25 − 0.125 + 0.1875,
    −0.25 + 0.375, 0.75). The baseline variant subtracts the group's mean score (1 and 3: 2) at the last token."""
    inputs, mask = estimator_inputs(torch.tensor([1.0, 3.0, 4.0, 8.0]), kl_coef=0.5, gamma=0.5)
    advantages, returns = ADVANTAGE_ESTIMATORS["reinforce_pp"](inputs)
    assert returns is None
    assert_close(advantages[0], torch.tensor([-0.25 + 0.5 * (-0.25) + 0.25 * 0.75, -0.25 + 0.5 * 0.75, 0.75]))
    assert_close(advantages[2], torch.tensor([4 - 0.25, 0.0, 0.0]))
    baseline, _ = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](inputs)
    assert_close(baseline[0], torch.tensor([-0.25 + 0.5 * (-0.25) + 0.25 * (0.75 - 2), -0.25 + 0.5 * (0.75 - 2),
                                            0.75 - 2]))
    assert_close(baseline[3, 2], torch.tensor(8 - 0.25 - 6.0))  # group (4, 8): mean 6
    assert torch.equal(baseline[~mask], torch.zeros(int((~mask).sum())))


def test_grpo_scale_rewards_group_batch_none_as_trl():
    """TRL 1.16's scale_rewards: group (each group's std), batch (the whole batch's std), none (Dr. GRPO: only the
    group mean is subtracted); std unbiased, + 1e-4."""
    scores = torch.tensor([1.0, 3.0, 4.0, 8.0])
    centred = torch.tensor([-1.0, 1.0, -2.0, 2.0])
    for scale, divisor in (("group", torch.tensor([2 ** 0.5] * 2 + [8 ** 0.5] * 2) + 1e-4),
                           ("batch", scores.std() + 1e-4), ("none", torch.tensor(1.0))):
        inputs, mask = estimator_inputs(scores, scale=scale)
        assert_close(ADVANTAGE_ESTIMATORS["grpo"](inputs)[0][:, 0], centred / divisor)


# --- the RL audit (TRL 1.16, verl's core_algos.py): unscored rows, REINFORCE++'s baselines, loss aggregations, GSPO's
# default aggregation, k3's clamp -------------------------------------------------------------------------------------

def unscored_inputs(raw, scale="group", kl_coef=0.0, gamma=1.0):
    """12 rows in groups of 4, NaN where no reward function scored the row (as make_experience passes them)."""
    mask = torch.ones(raw.numel(), 3, dtype=torch.bool)
    mask[1, 2:] = False
    scored = ~raw.isnan()
    scores = raw.nan_to_num(0.0)
    rewards = token_rewards(torch.full(mask.shape, 0.5), scores, mask, kl_coef)
    return AdvantageInputs(token_rewards=rewards, values=None, mask=mask, scores=scores, group_size=4, gamma=gamma,
                           lam=1.0, scale_rewards=scale, scored=scored), mask


UNSCORED = torch.tensor([1.0, 3.0, NAN, 2.0, 0.0, NAN, NAN, 5.0, NAN, 4.0, NAN, NAN])  # the last group: one scored


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_leaves_unscored_rows_out_of_the_group_statistics_as_trl(scale):
    """TRL 1.16 GRPOTrainer: rewards[unscorable] = NaN, nanmean / nanstd (of the group, or the batch), advantages
    nan_to_num(0). Before, an unscored row scored 0, entered its group's mean and std, and trained on its own
    advantage (−0.87 in the audit)."""
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="TRL is the reference implementation")
    grouped = UNSCORED.view(-1, 4)
    centred = (grouped - grouped.nanmean(dim=1, keepdim=True)).view(-1)
    std = {"group": trl_utils.nanstd(grouped, dim=1, keepdim=True).expand(-1, 4).reshape(-1),
           "batch": trl_utils.nanstd(UNSCORED).expand(12), "none": None}[scale]
    trl = (centred if std is None else centred / (std + 1e-4)).nan_to_num(0.0)
    inputs, mask = unscored_inputs(UNSCORED, scale=scale)
    advantages, _ = ADVANTAGE_ESTIMATORS["grpo"](inputs)
    assert_close(advantages, torch.where(mask, trl.unsqueeze(1), 0.0), atol=1e-5)
    assert (advantages[UNSCORED.isnan()] == 0).all()


def test_rloo_leaves_unscored_rows_out_of_the_baseline_as_trl():
    """TRL 1.16 RLOOTrainer: the leave-one-out mean over the scorable siblings only ((nansum − r) / (count − 1)); a
    group with one scorable sample and the unscorable rows get 0."""
    grouped = UNSCORED.view(-1, 4)
    count = (~grouped.isnan()).sum(dim=1, keepdim=True)
    baseline = (grouped.nansum(dim=1, keepdim=True) - grouped) / (count - 1)
    trl = (grouped - baseline).view(-1).nan_to_num(0.0)
    inputs, mask = unscored_inputs(UNSCORED)
    assert_close(ADVANTAGE_ESTIMATORS["rloo"](inputs)[0], torch.where(mask, trl.unsqueeze(1), 0.0))
    assert_close(trl[:4], [1 - 2.5, 3 - 1.5, 0.0, 2 - 2.0])  # by hand: group (1, 3, –, 2)


@pytest.mark.parametrize("name", ["reinforce_pp_baseline", "reinforce_pp_baseline_verl"])
def test_reinforce_pp_baselines_leave_unscored_rows_out_of_the_group_mean(name):
    """Group (1, 3, –, 2): the baseline is 2, the mean of the three scored rows (not 1.5 with a 0 for the unscored
    one); the unscored row's advantage is 0. γ = 1, no KL: both variants give score − 2 on every action token."""
    inputs, mask = unscored_inputs(UNSCORED)
    advantages, _ = ADVANTAGE_ESTIMATORS[name](inputs)
    assert_close(advantages[:4], torch.where(mask[:4], torch.tensor([-1.0, 1.0, 0.0, 0.0]).unsqueeze(1), 0.0))
    assert (advantages[UNSCORED.isnan()] == 0).all()
    assert_close(advantages[9], [0.0, 0.0, 0.0])  # the only scored row of its group: its own baseline


def test_reinforce_pp_baselines_openrlhf_and_verl_differ_with_the_kl_in_the_reward():
    """reinforce_pp_baseline (OpenRLHF): the score minus its group's mean score at the last token, then the
    return-to-go of the token rewards (−β·KL per token). reinforce_pp_baseline_verl (verl): the summed token rewards
    minus their group's mean, the same on every action token. Without a KL in the reward and γ = 1 they agree."""
    scores = torch.tensor([1.0, 3.0, 4.0, 8.0])
    plain, mask = estimator_inputs(scores)
    openrlhf, _ = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](plain)
    verl, _ = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline_verl"](plain)
    assert_close(verl, openrlhf)
    assert_close(verl[:, 0], [-1.0, 1.0, -2.0, 2.0])
    penalised, _ = estimator_inputs(scores, kl_coef=0.5)  # β·KL = 0.25 per token; lengths 3, 2, 1, 3
    openrlhf, _ = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](penalised)
    verl, _ = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline_verl"](penalised)
    returns = torch.tensor([1 - 0.75, 3 - 0.5, 4 - 0.25, 8 - 0.75])  # group means 1.375 and 5.5
    assert_close(verl, torch.where(mask, (returns - torch.tensor([1.375, 1.375, 5.5, 5.5])).unsqueeze(1), 0.0))
    assert_close(openrlhf[0], [-0.75 + 1 - 2, -0.5 + 1 - 2, -0.25 + 1 - 2])  # return-to-go, the score minus 2
    assert not torch.allclose(verl, openrlhf)


def test_every_reinforce_pp_estimator_is_normalised_by_whitening():
    from llmtrain.losses.advantages import needs_whitening

    assert set(needs_whitening) == set(ADVANTAGE_ESTIMATORS)
    assert [n for n, w in needs_whitening.items() if w] == ["reinforce_pp", "reinforce_pp_baseline",
                                                            "reinforce_pp_baseline_verl"]


AGG_LOSSES = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
AGG_MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])


def aggregated(name, losses=AGG_LOSSES, mask=AGG_MASK, max_new_tokens=4, rows=None):
    """The step's loss: Σ weighted losses / Σ counts over the micro-batches (`rows`: one per micro-batch)."""
    from llmtrain.losses.ppo import aggregation_weights

    total, count = 0.0, 0
    for part in rows or [slice(None)]:
        weights, n = aggregation_weights(mask[part], name, max_new_tokens, mini_batch_size=mask.shape[0])
        total, count = total + (losses[part] * weights).sum().item(), count + n
    return total / count


def test_loss_aggregations_by_hand():
    """Losses (1, 2, 3) and (4), max_new_tokens 4: token_mean 10/4; seq_mean_token_mean (2 + 4)/2; seq_mean_token_sum
    (6 + 4)/2; dr_grpo (TRL's) Σ/(B·max_new_tokens) = 10/8; seq_mean_token_sum_norm (verl's agg_loss) Σ/max_new_tokens
    = 10/4, not divided by the sequences, also when the mini-batch is split in micro-batches."""
    from llmtrain.losses.ppo import LOSS_AGGREGATIONS

    expected = {"token_mean": 2.5, "seq_mean_token_mean": 3.0, "seq_mean_token_sum": 5.0, "dr_grpo": 1.25,
                "seq_mean_token_sum_norm": 2.5}
    assert set(LOSS_AGGREGATIONS) == set(expected)
    for name, value in expected.items():
        assert math.isclose(aggregated(name), value, rel_tol=1e-6), name
        assert math.isclose(aggregated(name, rows=[slice(0, 1), slice(1, 2)]), value, rel_tol=1e-6), name


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_a_masked_out_row_counts_in_the_sequence_means_as_trl(grpo_batch, loss_type):
    """ppo.mask_truncated leaves a row without action tokens: TRL's grpo and dr_grpo still divide by every row (its
    loss is 0), dapo by the tokens; before, the sequence means left the row out of their count."""
    logp, old, ref, advantages, mask = grpo_batch
    mask = mask.clone()
    mask[1] = False  # truncated, masked
    trl_loss, _ = trl_grpo_loss(logp, old, ref, advantages, mask, loss_type=loss_type, beta=0.04,
                                bias_correction=False)
    _, per_token = ours(logp, old, ref, advantages, mask, 0.04)
    name = {"grpo": "seq_mean_token_mean", "dr_grpo": "dr_grpo", "dapo": "token_mean"}[loss_type]
    assert math.isclose(aggregated(name, per_token, mask, max_new_tokens=mask.size(1)), trl_loss, rel_tol=1e-6)


def test_gspo_aggregates_per_sequence_by_default():
    """ppo.loss_agg=null: seq_mean_token_mean under ppo.ratio=sequence (GSPO's objective, as the paper and verl: the
    mean over sequences of min(s·A, clip(s)·A)), token_mean otherwise; a set value is kept."""
    from llmtrain.losses.ppo import resolve_loss_agg

    assert resolve_loss_agg(None, "sequence") == "seq_mean_token_mean"
    assert resolve_loss_agg(None, "token") == "token_mean"
    assert resolve_loss_agg("token_mean", "sequence") == "token_mean"
    torch.manual_seed(1)
    mask = torch.tensor([[True] * 6, [True, True, False, False, False, False]])
    old = -torch.rand(2, 6)
    logp = old + torch.randn(2, 6) * 0.2
    advantages = torch.tensor([1.0, -0.5])
    terms = policy_loss_terms(logp, old, advantages.unsqueeze(1).expand_as(mask), mask, 0.2, ratio_level="sequence")
    s = torch.exp(torch.stack([(logp - old)[i][mask[i]].mean() for i in range(2)]))
    paper = -torch.minimum(s * advantages, s.clamp(0.8, 1.2) * advantages).mean()
    default = aggregated(resolve_loss_agg(None, "sequence"), terms.losses, mask, max_new_tokens=6)
    assert math.isclose(default, paper.item(), rel_tol=1e-5)
    assert not math.isclose(aggregated("token_mean", terms.losses, mask, max_new_tokens=6), paper.item(), rel_tol=1e-3)


def test_k3_estimate_is_clamped_as_verl():
    """verl's kl_penalty "low_var_kl": the log-ratio clamped to ±20, the estimate to [−10, 10], so one diverged token
    weighs at most 10 in the KL and gives it no gradient (before: e^20 − 21 ≈ 5e8)."""
    logp = torch.tensor([[-30.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    kl = KL_ESTIMATORS["k3"](logp, ref)
    assert_close(kl.detach(), [[10.0, math.exp(-0.5) + 0.5 - 1]])
    grad, = torch.autograd.grad(kl.sum(), logp)
    assert grad[0, 0] == 0 and grad[0, 1] != 0
