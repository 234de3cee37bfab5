"""Train–inference mismatch: TRL 1.16's vLLM importance-sampling correction and off-policy mask run on the same
batch as ours, then the mismatch metrics on a batch small enough to work out by hand."""

import inspect
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from llmtrain.losses.advantages import masked_sum
from llmtrain.losses.importance import (
    IMPORTANCE_SAMPLING_MODES,
    importance_weight_metrics,
    importance_weights,
    mismatch_metrics,
    off_policy_mask,
)
from llmtrain.losses.ppo import policy_loss_terms

LN2 = math.log(2.0)
MODES = sorted(IMPORTANCE_SAMPLING_MODES)


def grpo_trainer():
    return pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is the reference implementation").GRPOTrainer


def assert_close(actual, expected, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), rtol=tol, atol=tol)


@pytest.fixture
def batch():
    """6 completions of lengths 7…1, one with a tool-output hole, one token vLLM could not score (NaN)."""
    torch.manual_seed(0)
    lengths = [7, 5, 6, 3, 1, 4]
    tool_mask = [[1] * n for n in lengths]
    tool_mask[2][2:4] = [0, 0]  # tool output inside the completion: not an action token
    old = -torch.rand(6, 7) * 3  # (B, A) trainer log-probs
    engine = old + torch.randn(6, 7) * 0.8  # (B, A) wide enough that every bound below bites
    engine[1, 2] = float("nan")
    mask = torch.tensor([[j < n and (i != 2 or j not in (2, 3)) for j in range(7)] for i, n in enumerate(lengths)])
    engine[~mask] = -torch.inf  # garbage off the mask must not leak
    return SimpleNamespace(old=old, engine=engine, mask=mask, lengths=lengths, tool_mask=tool_mask)


def trl_sampling_pass(batch, mode, clip_max, clip_min):
    """TRL's GRPOTrainer._generate_and_score_completions, the smallest unit holding the IS ratio and its metrics
    (grpo_trainer.py ~2660–2707 and ~2860–2896), run unbound on a stand-in: _generate returns our completions and
    their engine log-probs (None where vLLM could not score, as vLLM does), the forward returns `batch.old`."""
    n = len(batch.lengths)
    engine_lists = [[None if math.isnan(x) else x for x in batch.engine[i, :k].tolist()]
                    for i, k in enumerate(batch.lengths)]
    generated = ([[1, 2]] * n, [[5] * k for k in batch.lengths], batch.tool_mask, ["c"] * n, engine_lists, {}, None,
                 None)
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, process_index=0),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False), _generate=lambda prompts: generated,
        environment_factories=None, environments=None, tools=None, _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None, mask_truncated_completions=False, num_iterations=1,
        args=SimpleNamespace(per_device_train_batch_size=n, steps_per_generation=1, gradient_accumulation_steps=1,
                             gradient_checkpointing_kwargs=None),
        use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=clip_max, vllm_importance_sampling_clip_min=clip_min,
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (batch.old, None, None), beta=0.0,
        _calculate_rewards=lambda *args: torch.arange(n, dtype=torch.float32).unsqueeze(1), num_generations=2,
        multi_objective_aggregation="sum_then_normalize", reward_weights=torch.ones(1), scale_rewards="group",
        reward_func_names=["r"], _metrics={"train": defaultdict(list)}, _pending_extra_logs={}, _pending_metrics={},
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list)}, log_multimodal=False)
    output = grpo_trainer()._generate_and_score_completions(trainer, [{"prompt": "p"}] * n)
    assert torch.equal((output["completion_mask"] * output["tool_mask"]).bool(), batch.mask)
    return output["importance_sampling_ratio"], {k: v[-1] for k, v in trainer._metrics["train"].items()}


# (clip_max, clip_min); 1.0 is a bound some weight sits on exactly: the unscored token's and the padding's
BOUNDS = [(3.0, None), (3.0, 0.5), (1.5, 0.8), (None, 0.5), (None, None), (1.5, 1.0), (1.0, 0.5)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip_max, clip_min", BOUNDS)
def test_weights_and_their_metrics_equal_trl(batch, mode, clip_max, clip_min):
    if mode.endswith("truncate") and clip_max is None and clip_min is None:
        with pytest.raises(RuntimeError):  # TRL reaches torch.clamp(min=None, max=None)
            trl_sampling_pass(batch, mode, clip_max, clip_min)
        with pytest.raises(ValueError, match="clip_max or clip_min"):
            importance_weights(batch.old, batch.engine, batch.mask, mode, clip_max, clip_min)
        return
    trl_ratio, trl_metrics = trl_sampling_pass(batch, mode, clip_max, clip_min)  # (B, A) or (B, 1)
    ours = importance_weights(batch.old, batch.engine, batch.mask, mode, clip_max, clip_min)  # (B, A)
    assert ours.shape == batch.mask.shape and ours.dtype == torch.float32
    assert_close(ours, trl_ratio.expand_as(ours))
    swapped = importance_weights(batch.engine, batch.old, batch.mask, mode, clip_max, clip_min)
    assert not torch.allclose(swapped, trl_ratio.expand_as(ours)), "the ratio's direction is checked"
    raw = importance_weights(batch.old, batch.engine, batch.mask, mode, None, 1e-30)  # unbounded but for 1e-30
    if (clip_max, clip_min) != (None, None):
        assert not torch.equal(ours, raw), "the bounds change some weight on this batch"
    for name, value in importance_weight_metrics(ours, batch.mask, mode).items():
        assert_close(value, trl_metrics[f"sampling/importance_sampling_ratio/{name.rsplit('_', 1)[1]}"])
    metrics = mismatch_metrics(batch.old, batch.engine, batch.mask, 0.2, 0.2)
    assert_close(metrics["mismatch_logp_abs_mean"], trl_metrics["sampling/sampling_logp_difference/mean"])
    assert_close(metrics["mismatch_logp_abs_max"], trl_metrics["sampling/sampling_logp_difference/max"])


def test_defaults_are_trls_and_so_is_the_bound_check():
    config = pytest.importorskip("trl", reason="TRL is the reference implementation").GRPOConfig
    fields = config.__dataclass_fields__
    ours = inspect.signature(importance_weights).parameters
    for name in ("mode", "clip_max", "clip_min"):
        assert ours[name].default == fields[f"vllm_importance_sampling_{name}"].default
    assert set(MODES) == {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}
    logps, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="clip_min"):
        importance_weights(logps, logps, mask, clip_max=1.0, clip_min=1.0)
    with pytest.raises(ValueError, match="unknown importance sampling mode"):
        importance_weights(logps, logps, mask, mode="sequence_clip")


def test_sequence_weight_is_the_product_of_token_ratios_and_detached():
    trainer = torch.tensor([[LN2, math.log(1.25), 5.0]], requires_grad=True)  # x = (ln 2, ln 1.25, masked off)
    mask = torch.tensor([[True, True, False]])
    engine = torch.zeros(1, 3)
    weights = importance_weights(trainer, engine, mask, "sequence_truncate", clip_max=None, clip_min=0.1)
    assert_close(weights, [[2.5, 2.5, 2.5]])
    assert not weights.requires_grad
    assert_close(importance_weights(trainer, engine, mask, "token_mask", clip_max=1.5), [[0.0, 1.25, 1.0]])
    assert_close(importance_weights(trainer, engine, mask, "sequence_mask", clip_max=2.0), [[0.0, 0.0, 0.0]])
    unscored = importance_weights(torch.zeros(1, 2), torch.tensor([[float("nan"), 0.0]]), mask[:, :2], "token_mask",
                                  clip_max=1.0, clip_min=1.0 - 1e-7)
    assert_close(unscored, [[1.0, 1.0]])  # weight 1 on an unscored token; a ratio on a bound is kept


@pytest.mark.parametrize("threshold", [0.05, 0.3])
@pytest.mark.parametrize("token_advantages", [False, True])
def test_off_policy_mask_equals_trl(batch, threshold, token_advantages):
    torch.manual_seed(1)
    policy = (batch.old + torch.randn_like(batch.old) * 0.3).requires_grad_()  # π_θ after a few updates
    advantages = torch.tensor([0.5, -1.0, -0.3, -0.8, 1.2, -0.1])  # (B,)
    if token_advantages:
        advantages = advantages.unsqueeze(1) + torch.randn(6, 7) * 0.5  # (B, A)
    behaviour = torch.where(batch.mask, batch.engine, 0.0)  # TRL pads the vLLM log-probs with 0
    trl_advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # as TRL's _compute_loss
    expected = grpo_trainer().get_off_policy_mask(advantages=trl_advantages, per_token_logps=policy,
                                                  sampling_per_token_logps=behaviour, mask=batch.mask.long(),
                                                  off_policy_threshold=threshold)
    ours = off_policy_mask(advantages, policy, batch.engine, batch.mask, threshold)
    assert ours.dtype == torch.float32 and not ours.requires_grad
    assert_close(ours, expected)
    negative = (advantages < 0).reshape(ours.size(0), -1)  # (B, 1) or (B, A), as the mask
    assert (ours == 0).any() and ((ours == 1) & negative).any(), "the KL decides some negative sequences"
    swapped = off_policy_mask(advantages, batch.engine.nan_to_num(0.0), policy.detach(), batch.mask, threshold)
    assert not torch.equal(swapped, ours), "KL(behaviour ‖ policy)'s direction is checked"



def test_off_policy_mask_by_hand():
    """behaviour − policy per token; keep when A ≥ 0 or the mean over the action tokens is ≤ δ (both inclusive)."""
    nan = float("nan")
    behaviour = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.5, 0.5], [nan, 0.5], [0.5, 9.0]])  # (B, A), policy = 0
    mask = torch.tensor([[True, True], [True, True], [True, True], [True, True], [True, False]])
    advantages = torch.tensor([0.0, -1.0, -1.0, -1.0, -1.0])
    keep = off_policy_mask(advantages, torch.zeros(5, 2), behaviour, mask, threshold=0.5)
    # A = 0 kept; KL 1 dropped; KL ½ = δ kept; an unscored token counts as 0 but still counts: (0 + ½) / 2;
    # the token off the mask is ignored
    assert keep.squeeze(1).tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert off_policy_mask(advantages, torch.zeros(5, 2), behaviour, mask, threshold=0.25).squeeze(1).tolist() == \
        [1.0, 0.0, 0.0, 1.0, 0.0]
    expected = grpo_trainer().get_off_policy_mask(advantages.unsqueeze(1), torch.zeros(5, 2),
                                                  torch.where(mask, behaviour, 0.0), mask.long(), 0.5)
    assert_close(keep, expected)

def test_weight_and_off_policy_mask_multiply_the_clipped_loss_as_trl(batch):
    """TRL's _compute_loss (dapo): per_token_loss · off_policy_mask · IS weight, after the PPO clip."""
    torch.manual_seed(2)
    policy = batch.old + torch.randn_like(batch.old) * 0.3
    advantages = torch.tensor([0.5, -1.0, -0.3, -0.8, 1.2, -0.1])
    weights = importance_weights(batch.old, batch.engine, batch.mask, "token_truncate", 2.0, 0.5)
    keep = off_policy_mask(advantages, policy, batch.engine, batch.mask, 0.05)
    assert (keep == 0).any() and (weights[batch.mask] != 1).any()
    mask, rows = batch.mask, batch.mask.size(0)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (policy, torch.zeros_like(policy), None),
        get_off_policy_mask=grpo_trainer().get_off_policy_mask,
        top_entropy_quantile=1.0, off_policy_mask_threshold=0.05, importance_sampling_level="token", beta=0.0,
        loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, use_vllm=True, vllm_importance_sampling_correction=True,
        max_completion_length=mask.size(1), args=SimpleNamespace(delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                    gather_for_metrics=lambda x: x),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": batch.old, "num_items_in_batch": mask.sum(),
              "sampling_per_token_logps": torch.where(mask, batch.engine, 0.0), "importance_sampling_ratio": weights}
    trl_loss = grpo_trainer()._compute_loss(trainer, None, inputs)
    terms = policy_loss_terms(policy, batch.old, advantages.unsqueeze(1).expand_as(mask), mask, 0.2)
    assert_close(masked_sum(terms.losses * keep * weights, mask) / mask.sum(), trl_loss)


# --- the metrics, by hand ------------------------------------------------------------------------------------------
# x = trainer − engine on the action tokens: ln 2, 0, −ln 4 (ratios 2, 1, ¼); the fourth token is off the mask.

@pytest.fixture
def tiny():
    trainer = torch.tensor([[LN2, 0.0], [-2 * LN2, 0.0]])
    engine = torch.tensor([[0.0, 0.0], [0.0, -torch.inf]])
    return trainer, engine, torch.tensor([[True, True], [True, False]])


def test_metrics_by_hand(tiny):
    trainer, engine, mask = tiny
    metrics = mismatch_metrics(trainer, engine, mask, clip_eps_low=0.8, clip_eps_high=1.5)  # ρ ∈ [0.2, 2.5]
    assert metrics.keys() == {"mismatch_logp_abs_max", "mismatch_logp_abs_mean", "mismatch_kl",
                              "mismatch_frac_outside_clip"}
    assert_close(metrics["mismatch_logp_abs_max"], 2 * LN2)
    assert_close(metrics["mismatch_logp_abs_mean"], LN2)  # (ln 2 + 0 + 2 ln 2) / 3
    # k3 = e^x − x − 1: (1 − ln 2) + 0 + (¼ + 2 ln 2 − 1), over 3 tokens
    assert_close(metrics["mismatch_kl"], (0.25 + LN2) / 3)
    assert metrics["mismatch_frac_outside_clip"] == 0.0
    assert_close(mismatch_metrics(trainer, engine, mask, 0.2, 0.2)["mismatch_frac_outside_clip"], 2 / 3)  # 2 and ¼
    assert_close(mismatch_metrics(trainer, engine, mask, 0.75, 1.0)["mismatch_frac_outside_clip"], 0.0)  # bounds in


def test_metrics_see_the_direction(tiny):
    trainer, engine, mask = tiny
    swapped = mismatch_metrics(torch.where(mask, engine, 0.0), trainer, mask, clip_eps_low=0.8, clip_eps_high=1.5)
    assert_close(swapped["mismatch_kl"], (2.5 - LN2) / 3)  # (ln 2 − ½) + 0 + (3 − 2 ln 2): not KL(engine‖trainer)
    assert_close(swapped["mismatch_frac_outside_clip"], 1 / 3)  # ratio 4 is outside [0.2, 2.5]


def test_unscored_tokens_are_left_out_and_an_empty_mask_gives_zeros(tiny):
    trainer, engine, mask = tiny
    with_nan = torch.cat([engine, torch.full((1, 2), float("nan"))])
    metrics = mismatch_metrics(torch.cat([trainer, torch.zeros(1, 2)]), with_nan,
                               torch.cat([mask, torch.ones(1, 2, dtype=torch.bool)]), 0.8, 1.5)
    assert metrics == mismatch_metrics(trainer, engine, mask, 0.8, 1.5)
    empty = torch.zeros(2, 2, dtype=torch.bool)
    assert set(mismatch_metrics(trainer, engine, empty, 0.2, 0.2).values()) == {0.0}
    for mode in MODES:
        weights = importance_weights(trainer, engine, empty, mode)
        assert torch.equal(weights, torch.ones(2, 2))  # nothing to correct: weight 1, as TRL's exp(0)
        expected = {0.0} if mode.startswith("token") else {1.0}  # TRL counts sequences, empty ones too
        assert set(importance_weight_metrics(weights, empty, mode).values()) == expected
    assert set(importance_weight_metrics(torch.ones(2, 0), torch.zeros(2, 0, dtype=torch.bool),
                                         "sequence_mask").values()) == {0.0}
