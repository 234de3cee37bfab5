"""A lean sampling loop over a causal LM with a DynamicCache: the tokens HF `generate` draws, without its per-call
and per-token machinery (config copies and validation, logits-processor and stopping-criteria objects, the model
kwargs' bookkeeping), which on a small model costs as much as the model's own decode steps.

It feeds the model exactly what `GenerationMixin._sample` feeds it (transformers 5.x: the prompt with positions
from the attention mask's cumulative sum, then one token a step with the next position and the mask grown by a
column; `logits_to_keep=1`), takes the last logits as float32, applies HF's own warpers in `generate`'s order
(temperature, top-k, top-p), and draws with `softmax` + `multinomial` (argmax when greedy): for the same RNG state
the same tokens, bit for bit (tests/unit/test_ppo_sampler.py checks it against `generate`). Finished rows get the
pad token, and the loop stops when every row has emitted an EOS or `max_new_tokens` are drawn, as `generate` does.

`sampled_module` says what the loop runs: the model itself where `supports` it, or under LoRA the transformers model
inside peft's wrapper (peft injects the adapters into its layers, so its forward is the adapted model's, and peft's
own `generate` only calls that model's); otherwise rollout.py calls `generate` (no KV cache, a model that overrides
`generate`'s steps, a prompt-learning peft method whose virtual tokens only peft's wrapper adds, an MoE whose decode
switches its experts kernel off the CPU).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationMixin
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from llmtrain.models.lora import is_peft, unwrap_peft

# generate's own steps this loop reproduces: a model that overrides one of them gets `generate`
DEFAULT_STEPS = ("generate", "_sample", "prepare_inputs_for_generation", "_update_model_kwargs_for_generation")


def supports(model: torch.nn.Module, use_cache: bool) -> bool:
    """The lean loop draws what `generate` draws for this model: a decoder-only HF causal LM that keeps generate's
    default input preparation and a DynamicCache, cache on."""
    if not use_cache or not isinstance(model, GenerationMixin) or model.config.is_encoder_decoder:
        return False
    kind = type(model)
    if any(getattr(kind, name) is not getattr(GenerationMixin, name) for name in DEFAULT_STEPS):
        return False
    if not model._supports_default_dynamic_cache():  # mamba-like models bring their own cache
        return False
    experts = getattr(model, "get_experts_implementation", None)
    switches_experts = experts is not None and "grouped_mm" in experts().values()  # generate's decode switch
    return not (switches_experts and model.device.type != "cpu")


def sampled_module(model: torch.nn.Module, use_cache: bool) -> torch.nn.Module | None:
    """The module the lean loop samples from for `model` (a peft LoRA wrapper: the adapted model inside it), or None
    where only `generate` draws the right tokens."""
    if is_peft(model) and model.active_peft_config.is_prompt_learning:
        return None
    model = unwrap_peft(model)
    return model if supports(model, use_cache) else None


def warpers(temperature: float, top_k: int, top_p: float) -> list:
    """The logits processors `generate` builds for do_sample with these settings, in its order."""
    out = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


def next_tokens(logits: torch.Tensor, input_ids: torch.Tensor, processors: list, sample: bool,
                logps: list | None = None) -> torch.Tensor:
    """(B, V) float32 logits of the last position -> (B,) drawn tokens; with `logps`, appends (B,) the log-prob of
    each drawn token under the distribution it was drawn from (after temperature, top-k, top-p: vLLM's
    processed_logprobs)."""
    for processor in processors:
        logits = processor(input_ids, logits)
    if sample:
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1).squeeze(1)
    else:
        tokens = torch.argmax(logits, dim=-1)
    if logps is not None:
        logps.append(torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1))
    return tokens


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int, temperature: float,
           top_k: int, top_p: float, pad_token_id: int, eos_ids: list[int],
           logps: list | None = None) -> torch.Tensor:
    """(B, P) left-padded prompts -> (B, P + a) with a <= max_new_tokens: what `generate` returns for the same
    sampling settings and RNG state (temperature 0: greedy). logps: a list that receives (B, a) fp32, each drawn
    token's log-prob as sampled (the behaviour policy's), without changing what is drawn."""
    sample_ = temperature > 0
    processors = warpers(temperature, top_k, top_p) if sample_ else []
    eos = torch.tensor(eos_ids, device=input_ids.device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # (B, P)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)
    step_ids = input_ids
    drawn_logps = [] if logps is not None else None
    for _ in range(max_new_tokens):
        logits = model(input_ids=step_ids, cache=cache, position_ids=position_ids, attention_mask=attention_mask,
                       logits_to_keep=1, use_cache=True, return_dict=True).logits
        logits = logits[:, -1].to(copy=True, dtype=torch.float32)  # (B, V)
        tokens = next_tokens(logits, input_ids, processors, sample_, drawn_logps)  # (B,)
        tokens = torch.where(unfinished, tokens, pad_token_id)
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        unfinished &= ~torch.isin(tokens, eos)
        if not bool(unfinished.any()):
            break
        step_ids = tokens[:, None]  # (B, 1)
        position_ids = position_ids[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
    if logps is not None:
        logps.append(torch.stack(drawn_logps, dim=1) if drawn_logps else input_ids.new_zeros((input_ids.shape[0], 0),
                                                                                             dtype=torch.float32))
    return input_ids
