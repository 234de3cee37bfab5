"""ppo.packing (stages/ppo/packed.py): a micro-batch of left-padded rollout rows packed into one row and read back
into the (b, A) layout, and the packed forwards of the actor, reference and critic against the padded ones on a
tiny Llama (fp32): log-probs, entropy, values and the gradients, also with a sliding window (Mistral), through LoRA
adapters on and off, and an MoE's router aux loss (Mixtral); generation unchanged by the packable sdpa; the settings
packing cannot honour refused with the field and the fix."""

from __future__ import annotations

import pytest
import torch

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.models.attention import PACKABLE_SDPA, SEGMENT_LENGTHS
from llmtrain.models.load import build_model
from llmtrain.stages.head import action_answer
from llmtrain.stages.ppo.build import attention_for_rollouts
from llmtrain.stages.ppo.checks import ppo_problems
from llmtrain.stages.ppo.experience import Experience, forward_rows, values_of
from llmtrain.stages.ppo.packed import NO_STATE, action_rows, action_values

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
PROMPT, ACTIONS = 6, 5  # the padded layout: (b, P + A)


def tiny(tokenizer, attention: str, head: str = "lm", fused: bool = True, config: dict = TINY):
    return build_model(name_or_path=None, from_config=config, config_path=None, tokenizer=tokenizer,
                       attn_implementation=attention, dropout=0.0, activation_checkpointing=False,
                       trust_remote_code=False, head=head, seed=0, fused_head_chunk=7 if fused else None)


def rollout_rows(vocab: int):
    """(3, P + A) rows as generate() leaves them: prompts of 6, 2 and 4 tokens left-padded, responses of 5, 2 and 3
    tokens right-padded (pad id 0), and the (3, A) action mask."""
    g = torch.Generator().manual_seed(2)
    prompt_lens, response_lens = [6, 2, 4], [5, 2, 3]
    sequences = torch.zeros(3, PROMPT + ACTIONS, dtype=torch.long)
    attention_mask = torch.zeros_like(sequences)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        sequences[i, PROMPT - p:PROMPT + r] = torch.randint(3, vocab, (p + r,), generator=g)
        attention_mask[i, PROMPT - p:PROMPT + r] = 1
    return sequences, attention_mask, attention_mask[:, PROMPT:].bool()


def test_packing_keeps_each_sample_and_points_at_the_state_before_each_action():
    """The packed row holds each row's real tokens back to back (prompt then response), positions restart per sample,
    and unpacking a per-token quantity at `states` gives the padded layout back: here the packed row's next token,
    which read at the state before action j is action j itself."""
    sequences, attention_mask, action_mask = rollout_rows(50)
    rows = action_rows(sequences, attention_mask, ACTIONS, PACKABLE_SDPA)
    tokens, positions = rows.inputs["input_ids"], rows.inputs["position_ids"]  # (1, N)
    assert rows.inputs[SEGMENT_LENGTHS] == ((11, 4, 7),) and tokens.shape == (1, 22)
    expected = torch.cat([row[mask.bool()] for row, mask in zip(sequences, attention_mask)])
    assert torch.equal(tokens[0], expected)
    assert positions[0].tolist() == [*range(11), *range(4), *range(7)]
    next_token = torch.cat([tokens[0, 1:], tokens.new_zeros(1)])[None].float()  # (1, N): position k -> token k + 1
    unpacked = action_values(next_token, rows, ACTIONS)  # (3, A)
    assert torch.equal(unpacked.long() * action_mask, sequences[:, PROMPT:] * action_mask)
    assert torch.equal(rows.states >= 0, torch.cat([action_mask, torch.zeros(3, 1, dtype=torch.bool)], 1))
    assert (rows.states[:, -1] == NO_STATE).all()
    padded = action_rows(sequences, attention_mask, ACTIONS, None)
    assert padded.states is None and torch.equal(padded.inputs["attention_mask"], attention_mask)


@pytest.mark.parametrize("family,fused", [("llama", True), ("llama", False), ("mistral", True)])
def test_packed_action_logps_entropy_and_gradients_equal_the_padded_ones(tokenizer, family, fused):
    """The actor's (and the reference's) forward: log p and entropy of every action through the fused head (and the
    full logits), and the gradient of a loss weighing every token differently, packed vs padded: within 1e-6.
    Mistral: a sliding window of 4, shorter than the samples, kept within each packed sample."""
    sequences, attention_mask, action_mask = rollout_rows(len(tokenizer))
    weights = torch.randn(3, ACTIONS, generator=torch.Generator().manual_seed(4)) * action_mask
    config = TINY if family == "llama" else {**TINY, "model_type": "mistral", "sliding_window": 4}
    answers, grads = [], []
    for attention in (None, PACKABLE_SDPA):
        model = tiny(tokenizer, PACKABLE_SDPA, fused=fused, config=config)
        rows = action_rows(sequences, attention_mask, ACTIONS, attention)
        answer = action_answer(model, rows.inputs, sequences, ACTIONS, temperature=0.7, entropy=True,
                               states=rows.states)
        (answer.logps * weights + 0.1 * answer.entropy * weights.flip(0) * action_mask).sum().backward()
        answers.append(answer)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    padded, packed = answers
    assert (packed.logps[~action_mask] == 0).all()  # no state after a response's end
    assert torch.allclose(packed.logps, padded.logps * action_mask, rtol=0, atol=1e-6)
    assert torch.allclose(packed.entropy * action_mask, padded.entropy * action_mask, rtol=0, atol=1e-6)
    for name in grads[0]:
        assert torch.allclose(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7), name


def test_packed_logps_through_lora_and_its_disabled_adapters_equal_the_padded_ones(tokenizer):
    """peft=lora: the actor (adapters on, their B weights drawn so that they matter) and the reference (the same
    model with its adapters disabled) pass the packed row and the kept positions through peft's forward."""
    from llmtrain.models.lora import LoraSettings

    sequences, attention_mask, action_mask = rollout_rows(len(tokenizer))
    model = build_model(name_or_path=None, from_config=TINY, config_path=None, tokenizer=tokenizer,
                        attn_implementation=PACKABLE_SDPA, dropout=0.0, activation_checkpointing=False,
                        trust_remote_code=False, seed=0, fused_head_chunk=7,
                        lora=LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules="all-linear",
                                          modules_to_save=None))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=g))

    def logps(attention):
        rows = action_rows(sequences, attention_mask, ACTIONS, attention)
        return action_answer(model, rows.inputs, sequences, ACTIONS, 1.0, states=rows.states).logps * action_mask

    with torch.no_grad():
        actor = [logps(a) for a in (None, PACKABLE_SDPA)]
        with model.disable_adapter():
            reference = [logps(a) for a in (None, PACKABLE_SDPA)]
    assert (actor[0] - reference[0]).abs().max() > 1e-3  # the adapters matter
    assert torch.allclose(actor[1], actor[0], rtol=0, atol=1e-6)
    assert torch.allclose(reference[1], reference[0], rtol=0, atol=1e-6)


def test_an_moe_actor_routes_the_packed_row_as_the_padded_rows(tokenizer):
    """Mixtral: the routers' aux loss of a packed row (every token real) equals the padded rows' over their real
    tokens, and the log-probs agree."""
    sequences, attention_mask, action_mask = rollout_rows(len(tokenizer))
    config = {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
              "router_aux_loss_coef": 0.5}
    model = tiny(tokenizer, PACKABLE_SDPA, config=config)
    answers = []
    with torch.no_grad():
        for attention in (None, PACKABLE_SDPA):
            rows = action_rows(sequences, attention_mask, ACTIONS, attention)
            answers.append(action_answer(model, rows.inputs, sequences, ACTIONS, 1.0, route=True, states=rows.states))
    (padded, padded_term, padded_stats), (packed, packed_term, packed_stats) = answers
    assert padded_term is not None and padded_term > 0
    assert torch.allclose(packed_term, padded_term, rtol=1e-5) and torch.allclose(packed_stats, padded_stats, rtol=1e-5)
    assert torch.allclose(packed.logps * action_mask, padded.logps * action_mask, rtol=0, atol=1e-6)


def test_packed_values_equal_the_padded_ones(tokenizer):
    """The critic's V_t at the state before each action (a sequence classifier's per-token scores)."""
    sequences, attention_mask, action_mask = rollout_rows(len(tokenizer))
    critic = tiny(tokenizer, PACKABLE_SDPA, head="scalar")
    mb = Experience.of_rollout(_rollout(sequences, attention_mask, action_mask), torch.zeros(3))
    with torch.no_grad():
        padded, packed = (values_of(critic, critic, mb, forward_rows(mb, a)) for a in (None, PACKABLE_SDPA))
    assert padded.abs().sum() > 0
    assert torch.allclose(packed, padded, rtol=0, atol=1e-6)


def _rollout(sequences, attention_mask, action_mask):
    from llmtrain.stages.ppo.rollout import Rollout

    return Rollout(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                   ended=action_mask.any(1), prompts=["p"] * 3, columns={}, real=torch.ones(3, dtype=torch.bool))


def test_generation_with_the_packable_sdpa_is_sdpa(tokenizer):
    """Generation is unchanged by ppo.packing: the packable sdpa samples the same tokens from left-padded prompts as
    transformers' sdpa (same weights, same seed)."""
    sequences, attention_mask, _ = rollout_rows(len(tokenizer))
    prompts, mask = sequences[:, :PROMPT], attention_mask[:, :PROMPT]
    outs = []
    for attention in ("sdpa", PACKABLE_SDPA):
        model = tiny(tokenizer, attention).eval()
        torch.manual_seed(0)
        outs.append(model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=6, do_sample=True,
                                   top_k=0, pad_token_id=tokenizer.pad_token_id, use_cache=True))
    assert torch.equal(outs[0], outs[1])


def test_what_packing_cannot_honour_is_refused():
    """Eager attention has no per-sample path for a packed row: refused before any model loads, by the config check
    (an explicit model.attn_implementation=eager) and at build (a family that falls back to eager)."""
    cfg = compose_config(["recipe=grpo_tiny", "ppo.packing=true", "model.attn_implementation=eager"])
    assert any("ppo.packing=true" in p and "eager" in p for p in ppo_problems(cfg, "grpo", 1))
    with pytest.raises(ConfigError, match="ppo.packing=false"):
        attention_for_rollouts("eager", packing=True)
    assert attention_for_rollouts("sdpa_segments", packing=True) == PACKABLE_SDPA
    assert attention_for_rollouts("sdpa_segments", packing=False) == "sdpa"
    assert attention_for_rollouts("flash_attention_2", packing=True) == "flash_attention_2"
