"""SimPO and ORPO losses: hand computations, stability, then TRL 1.16's own loss methods on the same batch."""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from llmtrain.losses.reference_free import LOGP_CLAMP, log1mexp, orpo_terms, simpo_terms
from tests import helpers

LN2 = math.log(2)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def log_odds(a: float) -> float:
    """log(p / (1 − p)) of p = e^a, in float64."""
    p = math.exp(a)
    return math.log(p / (1 - p))


# Length-averaged log-probs of (chosen, rejected) per pair: typical, near 0, around ln ½ (where log1mexp
# switches forms), far below, and both ways round.
A_CHOSEN = [-0.5, -1e-3, -0.69, -0.70, -2.0, -8.0, -0.05, -30.0]
A_REJECTED = [-2.0, -0.3, -0.70, -0.69, -0.5, -0.02, -7.5, -31.0]


# --- SimPO by hand ------------------------------------------------------------------------------

def test_simpo_by_hand():
    terms = simpo_terms(torch.tensor([-0.5, -2.0]), torch.tensor([-1.5, -1.0]), beta=2.0, gamma=0.5)
    # r_c − r_r − γ: 2·(−0.5 + 1.5) − 0.5 = 1.5 and 2·(−2 + 1) − 0.5 = −2.5; −logsigmoid(x) = softplus(−x)
    assert torch.allclose(terms.losses, torch.tensor([softplus(-1.5), softplus(2.5)]))
    assert torch.allclose(terms.chosen_rewards, torch.tensor([-1.0, -4.0]))
    assert torch.allclose(terms.rejected_rewards, torch.tensor([-3.0, -2.0]))


def test_simpo_equal_logps_cost_softplus_gamma():
    a = torch.tensor([-0.25, -3.0, -12.5])
    terms = simpo_terms(a, a.clone(), beta=2.5, gamma=1.4)
    assert torch.allclose(terms.losses, torch.full((3,), softplus(1.4)))
    assert torch.allclose(simpo_terms(a, a.clone(), beta=2.5, gamma=0.0).losses, torch.full((3,), LN2))


def test_simpo_gradient_and_detached_rewards():
    chosen = torch.tensor([-0.5, -2.0], requires_grad=True)
    rejected = torch.tensor([-1.5, -1.0], requires_grad=True)
    terms = simpo_terms(chosen, rejected, beta=2.0, gamma=0.5)
    assert not terms.chosen_rewards.requires_grad and not terms.rejected_rewards.requires_grad
    terms.losses.sum().backward()
    # d/da_c of −logsigmoid(β(a_c − a_r) − γ) is −β·sigmoid(−(β(a_c − a_r) − γ)); the opposite for a_r
    expected = torch.tensor([-2.0 * torch.sigmoid(torch.tensor(-x)).item() for x in (1.5, -2.5)])
    assert torch.allclose(chosen.grad, expected) and torch.allclose(rejected.grad, -expected)


# --- ORPO by hand -------------------------------------------------------------------------------

def test_orpo_by_hand():
    beta = 0.25
    terms = orpo_terms(torch.tensor(A_CHOSEN), torch.tensor(A_REJECTED), beta=beta)
    expected_odds = [log_odds(c) - log_odds(r) for c, r in zip(A_CHOSEN, A_REJECTED, strict=True)]
    assert torch.allclose(terms.log_odds, torch.tensor(expected_odds), rtol=1e-5, atol=1e-5)
    assert torch.allclose(terms.losses, torch.tensor([beta * softplus(-x) for x in expected_odds]),
                          rtol=1e-5, atol=1e-6)
    assert torch.allclose(terms.chosen_rewards, beta * torch.tensor(A_CHOSEN))
    assert torch.allclose(terms.rejected_rewards, beta * torch.tensor(A_REJECTED))


def test_orpo_equal_logps_cost_beta_ln2():
    a = torch.tensor([-1e-3, -0.5, -0.69314, -4.0, -40.0])
    terms = orpo_terms(a, a.clone(), beta=0.1)
    assert torch.equal(terms.log_odds, torch.zeros(5))
    assert torch.allclose(terms.losses, torch.full((5,), 0.1 * LN2))


def test_orpo_gradient_and_detached_terms():
    beta = 0.5
    chosen = torch.tensor(A_CHOSEN, requires_grad=True)
    rejected = torch.tensor(A_REJECTED, requires_grad=True)
    terms = orpo_terms(chosen, rejected, beta=beta)
    assert not any(t.requires_grad for t in (terms.log_odds, terms.chosen_rewards, terms.rejected_rewards))
    terms.losses.sum().backward()
    # d log_odds / d a_c = 1 / (1 − e^{a_c}); d(−β logsigmoid(z))/dz = −β·sigmoid(−z)
    expected_chosen, expected_rejected = [], []
    for c, r in zip(A_CHOSEN, A_REJECTED, strict=True):
        pull = -beta / (1 + math.exp(log_odds(c) - log_odds(r)))
        expected_chosen.append(pull / (1 - math.exp(c)))
        expected_rejected.append(-pull / (1 - math.exp(r)))
    assert torch.allclose(chosen.grad, torch.tensor(expected_chosen), rtol=1e-4, atol=1e-6)
    assert torch.allclose(rejected.grad, torch.tensor(expected_rejected), rtol=1e-4, atol=1e-6)


def test_log1mexp_is_accurate_on_both_sides_of_ln_half():
    mpmath = pytest.importorskip("mpmath")  # a dependency of torch (through sympy)
    mpmath.mp.dps = 50
    x = torch.tensor([-1e-6, -1e-4, -0.3, -0.6931, -0.6932, -1.0, -5.0, -20.0, -80.0], dtype=torch.float64)
    expected = torch.tensor([float(mpmath.log(1 - mpmath.exp(v))) for v in x.tolist()], dtype=torch.float64)
    assert torch.allclose(log1mexp(x), expected, rtol=1e-12, atol=1e-300)
    assert torch.allclose(log1mexp(x.float()), expected.float(), rtol=1e-6, atol=1e-30)


# --- stability ----------------------------------------------------------------------------------

EXTREMES = [0.0, -1e-12, -1e-7, -LOGP_CLAMP, -1e-3, -50.0, -1e3, -1e5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_logps_give_finite_losses_and_gradients(dtype):
    values = torch.tensor([(c, r) for c in EXTREMES for r in EXTREMES], dtype=dtype)  # every (chosen, rejected)
    for name, fn in (("simpo", lambda c, r: simpo_terms(c, r, beta=2.0, gamma=1.0)),
                     ("orpo", lambda c, r: orpo_terms(c, r, beta=0.1))):
        chosen = values[:, 0].clone().requires_grad_(True)
        rejected = values[:, 1].clone().requires_grad_(True)
        terms = fn(chosen, rejected)
        assert terms.losses.dtype == torch.float32, name
        assert torch.isfinite(terms.losses).all() and (terms.losses >= 0).all(), name
        terms.losses.sum().backward()
        assert torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all(), name


def test_orpo_prefers_the_likelier_chosen_response():
    """The odds ratio loss falls as the chosen response gets likelier, even extremely close to certainty."""
    chosen = torch.tensor([-1e-2, -1e-4, -LOGP_CLAMP])
    losses = orpo_terms(chosen, torch.full((3,), -0.5), beta=1.0).losses
    assert (losses.diff() < 0).all()


# --- against TRL 1.16's own loss methods --------------------------------------------------------

def random_logps(num_pairs: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) length-averaged log-probs of chosen and rejected responses, spread from −6 to near 0."""
    generator = torch.Generator().manual_seed(seed)
    chosen = -torch.rand(num_pairs, generator=generator).pow(2) * 6 - 1e-4
    rejected = -torch.rand(num_pairs, generator=generator).pow(2) * 6 - 1e-4
    return torch.cat([chosen, torch.tensor(A_CHOSEN)]), torch.cat([rejected, torch.tensor(A_REJECTED)])


def trl_self(config, *fields: str) -> SimpleNamespace:
    """The trainer attributes a TRL loss method reads, copied from a real TRL config (as its __init__ does)."""
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")),
                           **{field: getattr(config, field) for field in fields})


@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (10.0, 3.0), (0.1, 0.0)])
def test_simpo_matches_trl_cpo_simpo(beta, gamma, tmp_path):
    cpo = pytest.importorskip("trl.experimental.cpo", reason="TRL is the reference implementation")
    config = cpo.CPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, loss_type="simpo",
                           cpo_alpha=0.0, beta=beta, simpo_gamma=gamma)  # TRL's simpo_gamma is our gamma
    assert config.alpha == 0.0 and config.label_smoothing == 0.0
    trainer = trl_self(config, "beta", "label_smoothing", "loss_type", "cpo_alpha", "simpo_gamma", "alpha")
    chosen, rejected = random_logps()
    trl_losses, trl_chosen, trl_rejected = cpo.CPOTrainer.cpo_loss(trainer, chosen, rejected)

    terms = simpo_terms(chosen, rejected, beta=beta, gamma=gamma)
    assert torch.allclose(terms.losses, trl_losses, rtol=1e-5, atol=1e-6)
    assert torch.allclose(terms.chosen_rewards, trl_chosen) and torch.allclose(terms.rejected_rewards, trl_rejected)
    # with cpo_alpha = 0 CPO's step loss is the mean of these (no NLL term): ours is their sum over the pairs
    assert math.isclose(terms.losses.sum().item() / len(chosen), trl_losses.mean().item(), rel_tol=1e-5)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_matches_trl_odds_ratio_loss(beta, tmp_path):
    orpo = pytest.importorskip("trl.experimental.orpo", reason="TRL is the reference implementation")
    config = orpo.ORPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, beta=beta)
    trainer = trl_self(config, "beta")
    chosen, rejected = random_logps(seed=1)
    trl_likelihoods, trl_chosen, trl_rejected, trl_mean_ratio, trl_mean_log_odds = (
        orpo.ORPOTrainer.odds_ratio_loss(trainer, chosen, rejected))

    terms = orpo_terms(chosen, rejected, beta=beta)
    # TRL returns β·logsigmoid(log_odds) and subtracts it; ours is the loss to add
    assert torch.allclose(terms.losses, -trl_likelihoods, rtol=1e-5, atol=1e-7)
    assert math.isclose(terms.log_odds.mean().item(), trl_mean_log_odds.item(), rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(-terms.losses.mean().item() / beta, trl_mean_ratio.item(), rel_tol=1e-5)
    assert torch.allclose(terms.chosen_rewards, trl_chosen) and torch.allclose(terms.rejected_rewards, trl_rejected)


def test_log1mexp_matches_trl():
    orpo = pytest.importorskip("trl.experimental.orpo", reason="TRL is the reference implementation")
    x = -torch.logspace(-6, 3, 200)  # from −1e-6 to −1000, through ln ½
    assert torch.allclose(log1mexp(x), orpo.orpo_trainer.log1mexp(x), rtol=1e-6, atol=0)


# --- the stages: one step's loss and gradient against a direct computation ------------------------

class OneProcessEngine:
    """What Updater and the stages call on an engine, for a plain model on one CPU process (no optimizer)."""
    dp_group = None
    dp_size = 1
    skips_nonfinite_grads = False

    def __init__(self, model: torch.nn.Module):
        self.module = model
        self.ctx = SimpleNamespace(device=torch.device("cpu"))

    def no_sync(self, is_last_micro_batch: bool):
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def current_lr(self) -> float:
        return 0.0

    def clip_or_fused_step(self) -> torch.Tensor:
        return torch.zeros(())

    def step(self) -> None:
        pass


def tiny_lm():
    return helpers.tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                              attn_implementation="sdpa")


def pair_examples(lengths: list[tuple[int, int, int]], seed: int) -> list[dict]:
    """Preference examples with (prompt, chosen, rejected) lengths; labels mask the prompt."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for prompt_len, chosen_len, rejected_len in lengths:
        prompt = torch.randint(3, 64, (prompt_len,), generator=generator).tolist()
        example = {}
        for side, length in (("chosen", chosen_len), ("rejected", rejected_len)):
            response = torch.randint(3, 64, (length,), generator=generator).tolist()
            example[f"{side}_input_ids"] = prompt + response
            example[f"{side}_labels"] = [-100] * prompt_len + response
        examples.append(example)
    return examples


# two micro-batches of different sizes and response lengths: a mean of micro-batch means would differ
MICRO_BATCHES = ([(3, 2, 5), (1, 7, 3), (4, 4, 1)], [(2, 9, 2), (5, 1, 6)])


def response_logps(model, example: dict, side: str) -> torch.Tensor:
    """(len(response),) log-probs of one response's tokens, from a forward of that sequence alone."""
    ids = torch.tensor([example[f"{side}_input_ids"]])  # (1, T)
    labels = torch.tensor(example[f"{side}_labels"])  # (T,)
    logps = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)  # (T-1, V): position t predicts t+1
    targets = labels[1:]
    kept = targets != -100
    return logps[kept].gather(-1, targets[kept, None]).squeeze(-1)


def direct_loss(model, stage_name: str, beta: float, gamma: float = 0.0) -> torch.Tensor:
    """The step's loss from per-sequence forwards, in float64: what the global normalisation must give."""
    examples = [e for micro in MICRO_BATCHES for e in pair_examples(micro, seed=len(micro))]
    chosen = [response_logps(model, e, "chosen") for e in examples]
    rejected = [response_logps(model, e, "rejected") for e in examples]
    a_c = torch.stack([c.mean() for c in chosen])  # (P,)
    a_r = torch.stack([r.mean() for r in rejected])  # (P,)
    if stage_name == "simpo":
        return torch.nn.functional.softplus(-(beta * (a_c - a_r) - gamma)).mean()
    log_odds = (a_c - a_r) - (torch.log1p(-a_c.exp()) - torch.log1p(-a_r.exp()))  # (P,)
    nll = -torch.cat(chosen).sum() / sum(len(c) for c in chosen)  # over the chosen target tokens of the batch
    return nll + beta * torch.nn.functional.softplus(-log_odds).mean()


def make_stage(stage_name: str, padding_free: bool):
    from llmtrain.stages.base import ModelSource
    from llmtrain.stages.orpo import ORPOStage
    from llmtrain.stages.simpo import SimPOStage

    if stage_name == "simpo":
        return SimPOStage(ModelSource(None), pad_token_id=0, beta=2.0, gamma=0.5, padding_free=padding_free)
    return ORPOStage(ModelSource(None), pad_token_id=0, beta=0.3, padding_free=padding_free)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("stage_name", ["simpo", "orpo"])
def test_stage_step_and_eval_match_a_direct_computation(stage_name, padding_free):
    from llmtrain.stages.base import Updater

    stage = make_stage(stage_name, padding_free)
    assert set(stage.roles) == {"policy"} and stage.roles["policy"].trainable
    batches = [stage.collate(pair_examples(micro, seed=len(micro))).for_attention("sdpa") for micro in MICRO_BATCHES]
    model = tiny_lm()
    engines = {"policy": OneProcessEngine(model)}

    result = stage.train_step(batches, engines, Updater(torch.device("cpu"), skip_nonfinite=False))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    beta, gamma = stage.beta, getattr(stage, "gamma", 0.0)
    expected = direct_loss(model, stage_name, beta, gamma)
    expected.backward()
    assert result["pairs"] == 5
    assert math.isclose(result["loss"], expected.item(), rel_tol=1e-5)
    for ours, theirs in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-4, atol=1e-6)

    metrics = stage.evaluate(batches, engines)
    assert metrics["eval_pairs"] == 5 and math.isclose(metrics["eval_loss"], expected.item(), rel_tol=1e-5)
    assert 0 <= metrics["eval_reward_accuracy"] <= 1
    assert math.isclose(metrics["eval_reward_margin"], result["reward_margin"], rel_tol=1e-5, abs_tol=1e-7)


def test_orpo_counts_the_chosen_target_tokens_in_both_layouts():
    from llmtrain.stages.orpo import collate_orpo_pairs

    examples = pair_examples(MICRO_BATCHES[0], seed=3)
    expected = sum(chosen for _, chosen, _ in MICRO_BATCHES[0])
    for padding_free in (False, True):
        batch = collate_orpo_pairs(examples, pad_token_id=0, padding_free=padding_free)
        assert batch.num_chosen_targets == expected and batch.num_pairs == 3
        moved = batch.to("cpu").for_attention("sdpa")
        assert type(moved).__name__ == "ORPOPairBatch" and moved.num_chosen_targets == expected


def test_orpo_metrics_at_the_first_step():
    from llmtrain.stages.base import Updater

    stage = make_stage("orpo", padding_free=False)
    batches = [stage.collate(pair_examples(micro, seed=len(micro))) for micro in MICRO_BATCHES]
    model = tiny_lm()
    result = stage.train_step(batches, {"policy": OneProcessEngine(model)}, Updater(torch.device("cpu"), False))
    with torch.no_grad():
        examples = [e for micro in MICRO_BATCHES for e in pair_examples(micro, seed=len(micro))]
        chosen = [response_logps(model, e, "chosen") for e in examples]
    nll = -torch.cat(chosen).sum().item() / sum(len(c) for c in chosen)
    assert math.isclose(result["nll_loss"], nll, rel_tol=1e-5)
    assert math.isclose(result["reward_chosen"], 0.3 * sum(c.mean().item() for c in chosen) / 5, rel_tol=1e-5)
    assert math.isclose(result["loss"], nll - 0.3 * result["log_odds_ratio"], rel_tol=1e-5)


def test_stage_problems_name_the_field():
    from llmtrain.stages import orpo, simpo

    base = dict(data=SimpleNamespace(packing=False), model=SimpleNamespace(dropout=0.0))
    assert simpo.problems(SimpleNamespace(**base, simpo=simpo.SimPOConfig()), 1) == []
    assert orpo.problems(SimpleNamespace(**base, orpo=orpo.ORPOConfig()), 1) == []
    found = simpo.problems(SimpleNamespace(**base, simpo=simpo.SimPOConfig(beta=0.0, gamma=-1.0)), 1)
    assert len(found) == 2 and found[0].startswith("simpo.beta=0.0") and found[1].startswith("simpo.gamma=-1.0")
    assert orpo.problems(SimpleNamespace(**base, orpo=orpo.ORPOConfig(beta=0.0)), 1)[0].startswith("orpo.beta=0.0")
