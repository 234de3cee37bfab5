"""Rollout: the actor samples responses to a rank's prompts (KV cache on): with sampler.py's lean loop, which draws
the tokens HF `generate` draws, or with `generate` itself where the loop does not apply.

Layout of every sequence: the prompt left-padded to one width P (the same on every rank, so experience
can be gathered across ranks), then the response right-padded to one width A. The action mask marks
each generated token up to and including the first EOS; never build it as `token != pad` (pad is eos
for many tokenizers: that would drop the EOS, the very token a reward model scores at). Every forward
over these sequences takes the attention mask and position ids from the mask's cumulative sum, so a
left-padded prompt is seen exactly as the unpadded one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from llmtrain.data.prompts import PromptBatch
from llmtrain.distributed import all_reduce_max
from llmtrain.stages.ppo import sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    n_samples_per_prompt: int = 1
    use_cache: bool = True
    batch_size: int = 0  # sequences per `generate` call on a rank (their KV cache at once); 0: all of the rank's


@dataclass
class Rollout:
    sequences: torch.Tensor  # (B, P + A) long: left-padded prompt, then the response right-padded after its EOS
    attention_mask: torch.Tensor  # (B, P + A) long: 1 on prompt tokens and on action tokens
    action_mask: torch.Tensor  # (B, A) bool: generated tokens up to and including the first EOS
    ended: torch.Tensor  # (B,) bool: the response ends in an EOS (False: cut at max_new_tokens)
    prompts: list  # raw prompt of each sequence (repeated n_samples_per_prompt times, consecutively)
    columns: dict[str, list]  # the prompt rows' other columns, repeated likewise
    real: torch.Tensor  # (B,) bool: False for eval filler rows
    gather_s: float = 0.0  # seconds to make the actor whole for generation (ZeRO-3 gather, FSDP2 unshard)
    # (B, A) fp32: each action's log-prob as the sampler drew it (after temperature / top-k / top-p; 0 off the mask):
    # the behaviour policy's, which the train-inference mismatch compares with the trainer's
    engine_logps: torch.Tensor | None = None
    # multi-turn (stages/ppo/tools): each trajectory's last turn as text (what reward functions read), and the engine's
    # counts for the step's metrics (tools_call_frequency, ...), already over every dp rank
    texts: list[str] | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, -self.num_actions:]  # (B, A)


def model_inputs(sequences: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    """Forward inputs for left-padded sequences: positions count real tokens only."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    return {"input_ids": sequences, "attention_mask": attention_mask, "position_ids": position_ids}


def up_to_first_eos(tokens: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """(B, A) generated tokens -> (B, A) bool: True through the first EOS of each row (every token if none)."""
    is_eos = torch.isin(tokens, eos_ids).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


def generation_config(settings: SamplingSettings, pad_token_id: int, eos_ids: list[int]) -> GenerationConfig:
    sample = settings.temperature > 0
    return GenerationConfig(
        max_new_tokens=settings.max_new_tokens, do_sample=sample, temperature=settings.temperature if sample else None,
        # explicit values: None would let transformers fill in its own defaults (top_k 50), and the log-probs the
        # update takes are over the full softmax, so sampling must be from it too
        top_p=settings.top_p if sample else None, top_k=settings.top_k if sample else None,
        pad_token_id=pad_token_id, eos_token_id=eos_ids, use_cache=settings.use_cache)


def checkpoint_overrides(config: GenerationConfig | None) -> dict:
    """The sampling fields a checkpoint's generation config sets away from transformers' defaults
    (repetition_penalty, min_p, no_repeat_ngram_size, top_k/top_p, ...): what the neutral config overrides."""
    if config is None:
        return {}
    defaults = GenerationConfig().to_dict()
    ignored = {"eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version",
               "_from_model_config"}
    return {k: v for k, v in config.to_diff_dict().items() if k not in ignored and defaults.get(k, v) != v}


@contextlib.contextmanager
def neutral_generation_config(model: torch.nn.Module):
    """transformers fills every field our GenerationConfig leaves unset from the model's own generation_config
    (a checkpoint's sampling defaults). Inside this context every module's generation_config is transformers'
    default, so the samples come from softmax(logits / T) with the run's top-k/top-p only: what the loss scores."""
    saved = [(m, m.generation_config) for m in model.modules()
             if isinstance(getattr(m, "generation_config", None), GenerationConfig)]
    for module, _ in saved:
        module.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for module, config in saved:
            module.generation_config = config


def repeated_rows(batch: PromptBatch, n: int) -> tuple[list, dict]:
    """The batch's prompts and columns, each row n times (a prompt's samples consecutive: a GRPO group)."""
    return ([p for p in batch.prompts for _ in range(n)],
            {k: [v for v in values for _ in range(n)] for k, values in batch.columns.items()})


def left_pad(ids: torch.Tensor, mask: torch.Tensor, width: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, p) ids and mask -> (b, width), padding on the left (a prompt's padding never follows its tokens)."""
    extra = width - ids.shape[1]
    return F.pad(ids, (extra, 0), value=pad_token_id), F.pad(mask, (extra, 0), value=0)


Drawer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def drawer(model, settings: SamplingSettings, pad_token_id: int, eos_ids: list[int]) -> Drawer:
    """(b, P) prompts, mask -> ((b, P + a) tokens, (b, a) fp32 log-prob of each drawn token as sampled): the lean
    loop (sampler.py) where it draws what `generate` would, else `generate` with one neutral config for every call
    (run it inside neutral_generation_config), its processed scores giving the log-probs."""
    sampled = sampler.sampled_module(model, settings.use_cache)
    if sampled is not None:
        def lean(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logps = []
            out = sampler.sample(sampled, ids, mask, max_new_tokens=settings.max_new_tokens,
                                 temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                                 pad_token_id=pad_token_id, eos_ids=eos_ids, logps=logps)
            return out, logps[0]
        return lean
    config = generation_config(settings, pad_token_id, eos_ids)  # generate copies it: one serves every call

    def generated(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model.generate(input_ids=ids, attention_mask=mask, synced_gpus=False, generation_config=config,
                             output_scores=True, return_dict_in_generate=True)
        drawn = out.sequences[:, ids.shape[1]:]  # (b, a)
        scores = torch.stack(out.scores, dim=1).float()  # (b, a, V): after the warpers, as drawn
        return out.sequences, torch.log_softmax(scores, dim=-1).gather(2, drawn[..., None]).squeeze(2)

    return generated


@contextlib.contextmanager
def sampling_model(actor, seed: int, device: torch.device):
    """(the actor's model made whole for generation, the seconds that took: ZeRO-3's gather, FSDP2's unshard), with
    no grad, the actor's autocast, transformers' neutral generation config, and the sampling RNG seeded from `seed` on
    a fork of the global one (a rollout does not depend on what drew from it before, so resume replays it)."""
    devices = [device] if device.type == "cuda" else []
    start = time.perf_counter()
    with torch.no_grad(), actor.generation_context() as model, torch.random.fork_rng(devices=devices):
        gather_s = time.perf_counter() - start
        torch.manual_seed(seed)
        with actor.autocast(), neutral_generation_config(model):
            yield model, gather_s


def generate(actor, batch: PromptBatch, settings: SamplingSettings, *, pad_token_id: int, eos_ids: list[int],
             seed: int, group=None) -> Rollout:
    """Sample `n_samples_per_prompt` responses per prompt (a prompt's samples consecutive: a GRPO group).

    The sampling RNG is seeded from `seed` (the caller derives it from the run seed, the step and the dp
    rank): a rollout does not depend on what drew from the global RNG before, so resume replays it."""
    n = settings.n_samples_per_prompt
    ids, mask = padded_prompts(batch, n, pad_token_id, group)
    width = ids.shape[1]
    with sampling_model(actor, seed, ids.device) as (model, gather_s):
        draw, size = drawer(model, settings, pad_token_id, eos_ids), settings.batch_size or ids.shape[0]
        outs = [draw(ids[i:i + size], mask[i:i + size]) for i in range(0, ids.shape[0], size)]
    longest = max(out.shape[1] for out, _ in outs)  # a shorter call's rows all ended: pad after their EOS
    out = torch.cat([F.pad(out, (0, longest - out.shape[1]), value=pad_token_id) for out, _ in outs])
    logps = torch.cat([F.pad(lp, (0, longest - width - lp.shape[1])) for _, lp in outs])  # (B, a)
    return laid_out(ids, mask, out[:, width:], logps, batch, n, eos_ids, pad_token_id, group, gather_s=gather_s)


def laid_out(ids: torch.Tensor, mask: torch.Tensor, responses: torch.Tensor, logps: torch.Tensor, batch: PromptBatch,
             n: int, eos_ids: list[int], pad_token_id: int, group, gather_s: float = 0.0) -> Rollout:
    """The rollout from (B, P) left-padded prompts and (B, a) drawn responses with their (B, a) log-probs: responses
    cut after the first EOS and right-padded to the longest on any rank (every engine lays rollouts out so)."""
    eos = torch.tensor(eos_ids, device=responses.device)
    action_mask = up_to_first_eos(responses, eos)
    ended = (torch.isin(responses, eos) & action_mask).any(-1)
    num_actions = int(all_reduce_max(torch.tensor([max(responses.shape[1], 1)], device=ids.device), group).item())
    extra_columns = num_actions - responses.shape[1]
    responses = F.pad(responses.masked_fill(~action_mask, pad_token_id), (0, extra_columns), value=pad_token_id)
    logps = F.pad(logps.float().masked_fill(~action_mask, 0.0), (0, extra_columns))
    action_mask = F.pad(action_mask, (0, extra_columns), value=False)
    prompts, columns = repeated_rows(batch, n)
    return Rollout(sequences=torch.cat([ids, responses], 1), attention_mask=torch.cat([mask, action_mask.long()], 1),
                   action_mask=action_mask, ended=ended, prompts=prompts, columns=columns,
                   real=batch.real.repeat_interleave(n, 0), engine_logps=logps, gather_s=gather_s)


def padded_prompts(batch: PromptBatch, n: int, pad_token_id: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt repeated n times (a group's samples consecutive), left-padded to the widest on any rank."""
    ids, mask = batch.input_ids.repeat_interleave(n, 0), batch.attention_mask.repeat_interleave(n, 0)  # (B, P)
    width = int(all_reduce_max(torch.tensor([ids.shape[1]], device=ids.device), group).item())
    return left_pad(ids, mask, width, pad_token_id)


def decode_responses(tokenizer, rollout: Rollout, eos_ids: list[int]) -> list[str]:
    """Each response's text up to, not including, its EOS (what a reward function reads); a multi-turn rollout's last
    turn (its action mask is not one span)."""
    if rollout.texts is not None:
        return list(rollout.texts)
    responses = rollout.responses.cpu()
    keep = rollout.action_mask.cpu() & ~torch.isin(responses, torch.tensor(eos_ids))
    return tokenizer.batch_decode([row[m].tolist() for row, m in zip(responses, keep)], skip_special_tokens=True)
