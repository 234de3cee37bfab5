"""stages/ppo/sampler.py: the lean sampling loop draws, bit for bit, the tokens HF `generate` draws for the same
RNG state (the rollout's numbers must not change with it), with EOS and pad handling and every sampling setting the
stage supports; and it declines the models and settings it does not reproduce."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM

from llmtrain.stages.ppo import sampler
from llmtrain.stages.ppo.rollout import SamplingSettings, generation_config

PAD = 0


@pytest.fixture(scope="module")
def model(tiny_llama):
    model = tiny_llama(attn_implementation="sdpa", vocab_size=40, max_position_embeddings=128).eval()
    model.generation_config = GenerationConfig()  # as rollout.neutral_generation_config leaves it
    return model


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """6 left-padded prompts of lengths 3..8: (B, P) ids and mask."""
    generator = torch.Generator().manual_seed(1)
    lengths = [3, 8, 5, 6, 4, 8]
    ids = torch.full((len(lengths), max(lengths)), PAD)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, 40, (n,), generator=generator)
        mask[row, -n:] = 1
    return ids, mask


def both(model, settings: SamplingSettings, eos_ids: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = prompts()
    with torch.no_grad():
        torch.manual_seed(seed)
        expected = model.generate(input_ids=ids, attention_mask=mask,
                                  generation_config=generation_config(settings, PAD, eos_ids))
        torch.manual_seed(seed)
        found = sampler.sample(model, ids, mask, max_new_tokens=settings.max_new_tokens,
                               temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                               pad_token_id=PAD, eos_ids=eos_ids)
    return expected, found


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                       (0.9, 0, 0.8), (0.8, 7, 0.9), (0.0, 0, 1.0)])
def test_lean_loop_draws_what_generate_draws(model, temperature, top_k, top_p):
    settings = SamplingSettings(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p)
    for seed in range(3):
        probe, _ = both(model, settings, [39], seed)  # without a real EOS: 12 tokens for every row
        # EOS = tokens the rows draw early, so rows end at different steps and later steps pad them
        eos_ids = sorted({int(probe[0, 8 + 2]), int(probe[3, 8 + 4])} - {PAD})
        expected, found = both(model, settings, eos_ids, seed)
        assert found.shape == expected.shape and torch.equal(found, expected), (seed, eos_ids)
        ended = torch.isin(found[:, 8:], torch.tensor(eos_ids)).any(-1)
        assert ended.any(), "the EOS should end some row early"


def test_every_row_ending_stops_before_max_new_tokens(model):
    settings = SamplingSettings(max_new_tokens=12, temperature=0.0)
    probe, _ = both(model, settings, [39], 0)
    eos_ids = sorted(set(probe[:, 8].tolist()) - {PAD})  # greedy: each row's first token ends it
    expected, found = both(model, settings, eos_ids, 0)
    assert found.shape[1] == 8 + 1 and torch.equal(found, expected)


def test_supports_plain_causal_lms_with_the_cache_only(model):
    assert sampler.supports(model, use_cache=True)
    assert not sampler.supports(model, use_cache=False)

    class OwnGenerate(LlamaForCausalLM):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    other = OwnGenerate(model.config)
    assert not sampler.supports(other, use_cache=True)
    assert not sampler.supports(torch.nn.Linear(2, 2), use_cache=True)


def test_under_lora_the_loop_samples_the_adapted_model_as_peft_generate_does(model):
    """A peft LoRA wrapper overrides `generate`; the loop runs the transformers model inside it (its layers carry the
    adapters) and draws, bit for bit, what peft's own `generate` draws, adapters on (B made non-zero so they matter).
    A prompt-learning method (virtual tokens only the wrapper adds) keeps `generate`."""
    import copy

    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    torch.manual_seed(2)
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    assert sampler.sampled_module(lora, use_cache=True) is lora.get_base_model()
    settings = SamplingSettings(max_new_tokens=10, temperature=1.0)
    ids, mask = prompts()
    draws = {}
    for name, adapted in (("peft generate", lora), ("lean loop", None), ("base without adapters", model)):
        with torch.no_grad():
            torch.manual_seed(5)
            if adapted is None:
                draws[name] = sampler.sample(sampler.sampled_module(lora, True), ids, mask, max_new_tokens=10,
                                             temperature=1.0, top_k=0, top_p=1.0, pad_token_id=PAD, eos_ids=[39])
            else:
                draws[name] = adapted.generate(input_ids=ids, attention_mask=mask,
                                               generation_config=generation_config(settings, PAD, [39]))
    assert torch.equal(draws["lean loop"], draws["peft generate"])
    assert not torch.equal(draws["lean loop"], draws["base without adapters"])  # the adapters were sampled
    prompt_tuned = get_peft_model(copy.deepcopy(model), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert sampler.sampled_module(prompt_tuned, use_cache=True) is None
