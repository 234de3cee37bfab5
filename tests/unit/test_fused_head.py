"""The fused LM head and loss (models/fused_head.py) against the unfused computation on the full logits: the chunk
functions on random tensors, then every stage's step (loss, grad norm, every weight after the step) and eval on a
tiny model, packed and padded, RL's action log-probs and entropy with their gradients, softcapping and tied
embeddings (Gemma 2), a family that transforms its logits (Cohere: refused), and what the forward keeps for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtrain.backends.base import OptimizerSpec
from llmtrain.backends.ddp import DDPBackend
from llmtrain.data.packing import merge_packed
from llmtrain.distributed import DistContext
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.attention import SEGMENT_ATTENTION
from llmtrain.models.fused_head import (
    ChunkedTokenLogps,
    ChunkedTokenLoss,
    ChunkSettings,
    HeadQuery,
    asking,
    default_chunk_tokens,
    install,
    negative_log_likelihood,
    shifted_targets,
)
from llmtrain.models.load import build_model
from llmtrain.roles import ModelOptions, build_engines
from llmtrain.stages.base import ModelSource, Updater
from llmtrain.stages.causal_lm import CausalLMStage
from llmtrain.stages.dpo import DPOStage
from llmtrain.stages.head import action_answer
from llmtrain.stages.orpo import ORPOStage
from llmtrain.stages.simpo import SimPOStage

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
# families that scale the logits after the head (the fused head applies the scale itself): × 1/4 and / 4
SCALED = {"cohere": {**TINY, "model_type": "cohere", "logit_scale": 0.25},
          "granite": {**TINY, "model_type": "granite", "logits_scaling": 4.0}}
CHUNK = 7  # tokens per chunk: not a divisor of any batch here, so the last chunk is short
REL = 1e-6


def assert_rel(ours, reference, rel=REL, scale=None):
    ours, reference = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    scale = reference.abs().max().clamp(min=1e-12) if scale is None else scale
    assert ((ours - reference).abs().max() / scale).item() <= rel, f"{ours} vs {reference}"


# ---- the chunk functions ---------------------------------------------------------------------------------------

def unfused(hidden, weight, bias, targets, temperature, softcap):
    z = F.linear(hidden, weight, bias)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z / temperature
    logp = -F.cross_entropy(z, targets, ignore_index=IGNORE_INDEX, reduction="none")
    log_probs = F.log_softmax(z, -1)
    return logp, -(log_probs.exp() * log_probs).sum(-1), (z.argmax(-1) == targets) & (targets != IGNORE_INDEX)


@pytest.mark.parametrize("temperature, softcap, with_bias", [(1.0, None, False), (0.7, None, True), (1.0, 5.0, False),
                                                              (1.3, 5.0, True)])
def test_chunked_functions_equal_the_full_logits(temperature, softcap, with_bias):
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 101
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g, requires_grad=True) if with_bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = IGNORE_INDEX
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    logp, entropy, correct = unfused(hidden, weight, bias, targets, temperature, softcap)
    settings = ChunkSettings(CHUNK, temperature, softcap, entropy=True, accuracy=True)
    out = ChunkedTokenLogps.apply(hidden, weight, bias, targets, settings)  # (n, 3)
    # the same operations on a (chunk, V) as on an (n, V) tensor; the CPU's vectorised kernels (the entropy's sum
    # over V, tanh under softcapping) may still round one element differently by shape (measured: 1 ulp on an AMD
    # EPYC, bitwise on others), so log p and entropy are held to the 1e-6 of the rest
    assert torch.equal(out[:, 2].bool(), correct)
    assert_rel(out[:, 0], logp)
    assert_rel(out[:, 1], entropy)
    upstream = torch.randn(n, 3, generator=g)  # a different gradient for every token and output
    expected = torch.autograd.grad((logp * upstream[:, 0] + entropy * upstream[:, 1]).sum(), inputs,
                                   retain_graph=True)
    for ours, theirs in zip(torch.autograd.grad((out * upstream).sum(), inputs), expected):
        assert_rel(ours, theirs)
    weights, entropy_weights = torch.randn(2, n, generator=g)  # each token's log p and entropy weighed differently

    def token_loss(rows, logp_, entropy_):
        return -(logp_ * weights[rows]).sum() + 0.1 * (entropy_ * entropy_weights[rows]).sum()

    packed = ChunkedTokenLoss.apply(hidden, weight, bias, targets, settings, True, token_loss)  # (n, 3)
    expected_loss = token_loss(slice(0, n), logp, entropy)
    assert_rel(packed[:, 0], logp)
    assert_rel(packed[:, 1], entropy)
    assert_rel(packed[0, 2], expected_loss)
    expected = torch.autograd.grad(expected_loss * 0.3, inputs)
    for ours, theirs in zip(torch.autograd.grad(packed[0, 2] * 0.3, inputs), expected):
        assert_rel(ours, theirs)


def test_default_chunk_follows_the_vocabulary_and_hidden_size():
    assert default_chunk_tokens(128_256, 4096) == 256  # Llama 3 8B: 128 MiB of fp32 logits per chunk
    assert default_chunk_tokens(32_000, 4096) == 1024  # Llama 2 7B
    assert default_chunk_tokens(151_936, 256) == 256  # a narrow model: 128 MiB chunks all the same
    assert default_chunk_tokens(151_936, 65_536) == 4096  # the ceiling


# ---- every stage's step and eval -------------------------------------------------------------------------------

# Adam's first step moves each weight by lr·g/(|g| + eps): with eps=1e-8 an element whose gradient is within rounding
# of zero (attention projections of a random tiny model have some) turns a 1e-7 difference of g into a large one of the
# step. eps=1e-3 keeps the step proportional to the gradient, so the weights compare as the gradients do.
OPTIM = OptimizerSpec(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-3, warmup_steps=0, schedule="constant",
                      min_lr_ratio=1.0, max_grad_norm=1.0, max_steps=2)


def engines_for(stage, tokenizer, fused: bool, attention: str = "sdpa"):
    backend = DDPBackend(DistContext(0, 0, 1, torch.device("cpu")), "fp32")
    options = ModelOptions(attention, 0.0, False, CHUNK if fused else None)
    return build_engines(stage.roles, backend, tokenizer, options, 0, OPTIM)


def sft_batches(stage, packed: bool):
    g = torch.Generator().manual_seed(3)
    examples = []
    for length in (9, 5, 12, 7):
        ids = torch.randint(3, 250, (length,), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 3 + ids[3:]})
    if packed:
        return [stage.collate([merge_packed(examples[:2])]), stage.collate([merge_packed(examples[2:])])]
    return [stage.collate(examples[:2]), stage.collate(examples[2:])]


def pair_batches(stage, packed: bool):
    g = torch.Generator().manual_seed(1)
    merged = []
    for _ in range(4):
        prompt, chosen, rejected = (torch.randint(3, 200, (k,), generator=g).tolist() for k in (5, 4, 6))
        merged.append({f"{side}_{key}": value for side, response in (("chosen", chosen), ("rejected", rejected))
                       for key, value in (("input_ids", prompt + response),
                                          ("labels", [IGNORE_INDEX] * len(prompt) + response))})
    stage.collate.keywords["padding_free"] = packed
    return [stage.collate(merged[:2]), stage.collate(merged[2:])]


STAGES = {
    "sft": (lambda tok: CausalLMStage("sft", ModelSource(None, TINY), tok.pad_token_id), sft_batches),
    "dpo": (lambda tok: DPOStage(ModelSource(None, TINY), tok.pad_token_id, beta=0.5, loss="sigmoid",
                                 label_smoothing=0.1), pair_batches),
    "dpo_ipo": (lambda tok: DPOStage(ModelSource(None, TINY), tok.pad_token_id, beta=0.5, loss="ipo",
                                     label_smoothing=0.0), pair_batches),
    "simpo": (lambda tok: SimPOStage(ModelSource(None, TINY), tok.pad_token_id, beta=2.0, gamma=0.5), pair_batches),
    "orpo": (lambda tok: ORPOStage(ModelSource(None, TINY), tok.pad_token_id, beta=0.1), pair_batches),
    "sft_cohere": (lambda tok: CausalLMStage("sft", ModelSource(None, SCALED["cohere"]), tok.pad_token_id),
                   sft_batches),
    "dpo_granite": (lambda tok: DPOStage(ModelSource(None, SCALED["granite"]), tok.pad_token_id, beta=0.5,
                                         loss="sigmoid", label_smoothing=0.1), pair_batches),
}


def step_and_eval(name, tokenizer, fused: bool, packed: bool):
    make_stage, make_batches = STAGES[name]
    stage = make_stage(tokenizer)
    attention = SEGMENT_ATTENTION if packed else "sdpa"
    engines = engines_for(stage, tokenizer, fused, attention)
    batches = [b.for_attention(attention) for b in make_batches(stage, packed)]
    updater = Updater(torch.device("cpu"), skip_nonfinite=False)
    metrics = [stage.train_step(batches, engines, updater)]
    weights = {n: p.detach().clone() for n, p in engines["policy"].model.named_parameters()}  # after one step
    metrics.append(stage.train_step(batches, engines, updater))
    return metrics, stage.evaluate(batches, engines), weights


def metric_scale(record: dict, key: str) -> float:
    """What a metric's difference is judged against: itself, but β·(π − ref) rewards (the eval's margin: against the
    last step's terms) and ORPO's log odds ratio, differences of near-equal log-prob terms, against those terms."""
    if (key.startswith(("reward_", "eval_reward_margin")) or key == "log_odds_chosen") and "logp_chosen" in record:
        return max(abs(record["logp_chosen"]), abs(record["logp_rejected"]), abs(record[key]))
    return max(abs(record[key]), 1e-12)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(STAGES))
def test_every_stage_steps_and_evaluates_as_with_full_logits(tokenizer, name, packed):
    """Loss, grad norm and every metric of two steps, every weight after the first, and the eval after the second equal
    the unfused path's (fp32, 1e-6 relative)."""
    fused, full = (step_and_eval(name, tokenizer, f, packed) for f in (True, False))
    for ours, theirs in zip(fused[0], full[0]):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert_rel(ours[key], theirs[key], scale=metric_scale(theirs, key))
    assert fused[1].keys() == full[1].keys()
    for key in fused[1]:
        assert_rel(fused[1][key], full[1][key], scale=metric_scale({**full[0][-1], **full[1]}, key))
    for name_ in fused[2]:
        assert_rel(fused[2][name_], full[2][name_])


# ---- RL: the action log-probs and entropy, with their gradients -----------------------------------------------

def tiny(tokenizer, fused: bool, from_config=TINY):
    return build_model(name_or_path=None, from_config=from_config, config_path=None, tokenizer=tokenizer,
                       attn_implementation="eager", dropout=0.0, activation_checkpointing=False,
                       trust_remote_code=False, seed=0, fused_head_chunk=CHUNK if fused else None)


def rollout(vocab: int):
    g = torch.Generator().manual_seed(2)
    sequences = torch.randint(3, vocab, (3, 14), generator=g)
    attention_mask = torch.ones_like(sequences)
    attention_mask[0, :4] = 0  # a left-padded prompt
    return sequences, attention_mask


@pytest.mark.parametrize("family", ["llama", "gemma2", "cohere", "granite"])
def test_action_logps_and_entropy_equal_the_full_logits_with_their_gradients(tokenizer, family):
    """PPO/GRPO's per-token log-probs and entropy at a temperature, and the gradient of a loss that weighs every
    token differently; Gemma 2: final-logit softcapping and tied embeddings go through the fused head too; Cohere and
    Granite: their scale of the logits (× logit_scale, / logits_scaling), put back after each fused forward."""
    gemma2 = {**TINY, "model_type": "gemma2", "head_dim": 16, "final_logit_softcapping": 3.0, "sliding_window": 8}
    config = {"llama": TINY, "gemma2": gemma2, **SCALED}[family]
    sequences, attention_mask = rollout(len(tokenizer))
    inputs = {"input_ids": sequences, "attention_mask": attention_mask}
    weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(4))
    answers, grads = [], []
    for fused in (True, False):
        model = tiny(tokenizer, fused, config)
        answer = action_answer(model, inputs, sequences, 5, temperature=0.7, entropy=True)
        (answer.logps * weights + 0.1 * answer.entropy * weights.flip(0)).sum().backward()
        answers.append(answer)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    if family == "gemma2":
        assert model.config.final_logit_softcapping == 3.0  # put back after each fused forward
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if family == "cohere":
        assert model.logit_scale == model.config.logit_scale == 0.25
    if family == "granite":
        assert model.config.logits_scaling == 4.0
    assert_rel(answers[0].logps, answers[1].logps)
    assert_rel(answers[0].entropy, answers[1].entropy)
    for name in grads[1]:
        assert_rel(grads[0][name], grads[1][name], rel=1e-5)


@pytest.mark.parametrize("case", ["unknown transform", "scale field it never reads"])
def test_a_family_that_transforms_its_logits_otherwise_is_refused(tokenizer, case):
    """A model that changes the head's output in a way the fused path does not know (here a hook adding 1 to the
    logits), or whose config holds a scale field its forward never applies (Llama given logit_scale: the first query's
    probe finds the output not doubled): the first fused forward stops with the setting that avoids it rather than
    training on a wrong loss."""
    if case == "unknown transform":
        model = tiny(tokenizer, True)
        model.register_forward_hook(lambda module, args, out: out.__setitem__("logits", out.logits + 1) or out)
    else:
        model = tiny(tokenizer, False)
        model.config.logit_scale = 0.5
        assert install(model, CHUNK) and model.get_output_embeddings().logit_multiplier == 0.5
    sequences, attention_mask = rollout(len(tokenizer))
    with pytest.raises(RuntimeError, match="model.fused_loss=off"):
        action_answer(model, {"input_ids": sequences, "attention_mask": attention_mask}, sequences, 5, 1.0)


def test_the_forward_keeps_no_logits_for_backward(tokenizer):
    """What autograd saves during an SFT forward: with the fused head nothing of (tokens, V) size, or of one chunk's
    (CHUNK, V) size beyond the head's own weight; with full logits at least one (tokens, V) tensor."""
    batch = sft_batches(CausalLMStage("sft", ModelSource(None, TINY), tokenizer.pad_token_id), packed=False)[0]
    tokens, vocab = batch.labels.numel(), len(tokenizer)
    for fused in (True, False):
        model = tiny(tokenizer, fused)
        saved: list[int] = []

        def pack(t: torch.Tensor, sizes: list[int] = saved) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with asking(model, HeadQuery(shifted_targets(batch.labels), token_loss=negative_log_likelihood)) as ask:
                ask.read(model(**batch.model_inputs(), **ask.kwargs).logits)
        largest = max(saved)
        if fused:
            assert largest <= vocab * TINY["hidden_size"]  # the head's weight; no logits, not even a chunk
        else:
            assert largest >= tokens * vocab


@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_the_ppo_policy_loss_in_the_fused_head_equals_the_full_logits(tokenizer, ratio):
    """GRPO's update loss (clipped surrogate with clip-higher and dual-clip, entropy bonus, k3 KL, seq-mean-token-mean
    weights), computed per token inside the fused head with its gradient in the forward (token ratios) or from the
    head's log-probs (GSPO's sequence ratio), against the same loss on the full logits: loss, statistics and every
    parameter's gradient."""
    from llmtrain.compose import compose_config
    from llmtrain.stages.ppo.experience import Experience
    from llmtrain.stages.registry import build_stage

    cfg = compose_config(["recipe=grpo_tiny", "ppo.entropy_coef=0.01", "ppo.clip_eps_high=0.28",
                          "ppo.clip_ratio_c=3.0", "ppo.loss_agg=seq_mean_token_mean", f"ppo.ratio={ratio}",
                          "ppo.epochs=2"])  # two epochs: the old log-probs come from the experience
    stage = build_stage(cfg, tokenizer, "sdpa")
    stage.kl_loss_coef = 0.05
    sequences, attention_mask = rollout(len(tokenizer))
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    results = []
    for fused in (True, False):
        model = tiny(tokenizer, fused)
        with torch.no_grad():
            from llmtrain.stages.ppo.rollout import model_inputs

            base = action_answer(model, model_inputs(sequences, attention_mask), sequences, 5, temperature=1.0).logps
        mb = Experience(sequences=sequences, attention_mask=attention_mask, action_mask=mask,
                        old_logps=base + 0.2 * torch.randn(3, 5, generator=torch.Generator().manual_seed(6)),
                        ref_logps=base - 0.1, values=torch.zeros(3, 5), token_rewards=torch.zeros(3, 5),
                        advantages=torch.randn(3, 5, generator=g) if fused else results[0][3],
                        returns=torch.zeros(3, 5), scores=torch.zeros(3), kl=torch.zeros(3, 5),
                        ended=torch.ones(3, dtype=torch.bool))
        loss, stats = stage._policy_loss(model, mb)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()},
                        mb.advantages))
    (loss_f, stats_f, grads_f, _), (loss_u, stats_u, grads_u, _) = results
    assert_rel(loss_f, loss_u)
    assert_rel(stats_f, stats_u)
    assert stats_f[0] > 0 or ratio == "sequence"  # some tokens clipped (the sequences' mean ratios stay inside)
    for name in grads_u:
        assert_rel(grads_f[name], grads_u[name], rel=1e-5)
