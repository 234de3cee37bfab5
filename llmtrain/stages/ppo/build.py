"""The config's ppo.* onto the PPO stage's plain arguments (config stops at builders). The reward function is
imported here, before any model loads: a wrong `module:attribute` fails fast, on every rank."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import GenerationConfig

from llmtrain.config import ConfigError
from llmtrain.data.prompts import PROMPT_FORMATS
from llmtrain.distributed import resolve_device, resolve_precision
from llmtrain.losses.advantages import needs_critic
from llmtrain.losses.kl import build_kl_controller
from llmtrain.losses.ppo import resolve_loss_agg
from llmtrain.models.attention import PACKABLE_SDPA, SEGMENT_ATTENTION
from llmtrain.models.flex import FLEX_IMPLEMENTATIONS
from llmtrain.models.stop_tokens import derive_stop_tokens
from llmtrain.stages.base import ModelSource, RoleSpec
from llmtrain.stages.ppo.async_rollout import AsyncRollouts
from llmtrain.stages.ppo.checks import ppo_problems
from llmtrain.stages.ppo.config import PPOConfig
from llmtrain.stages.ppo.engines import HFEngine
from llmtrain.stages.ppo.experience import ExperienceSettings
from llmtrain.stages.ppo.packed import PACKED_ATTENTIONS
from llmtrain.stages.ppo.remote_reward import RemoteReward
from llmtrain.stages.ppo.rewards import (
    RewardFunction,
    ScoreShaping,
    load_reward_functions,
    reward_model_statistics,
)
from llmtrain.stages.ppo.rollout import SamplingSettings, checkpoint_overrides
from llmtrain.stages.ppo.stage import PPOStage
from llmtrain.stages.ppo.tools import attach as attach_tools
from llmtrain.stages.ppo.tools import uses_tools
from llmtrain.stages.ppo.update import UpdateSettings
from llmtrain.stages.spec import RLShape, StageSpec


def ppo_roles(cfg, source: ModelSource) -> dict[str, RoleSpec]:
    """actor (trainable), critic (trainable, when the advantage needs one), reference (frozen copy of the initial
    actor, or the actor with adapters disabled under peft=lora), reward (a frozen reward model, when
    ppo.reward.model is set)."""
    p = cfg.ppo
    reward_source = None if p.reward.model is None else ModelSource(p.reward.model,
                                                                   trust_remote_code=source.trust_remote_code)
    roles = {"actor": RoleSpec(source, head="lm", trainable=True, lr=p.actor.lr)}
    if needs_critic.get(p.advantage, False):
        critic_source = reward_source if p.critic.init == "reward" else source  # policy: a fresh, seeded value head
        roles["critic"] = RoleSpec(critic_source, head="scalar", trainable=True, lr=p.critic.lr)
    # under peft=lora: the actor with its adapters off (no second copy of the base); else a frozen copy. None when
    # β = 0 and fixed: nothing reads its log-probs (TRL builds none either)
    if uses_reference(p.kl):
        roles["reference"] = RoleSpec(source, head="lm", trainable=False, adapter_off_of="actor")
    if reward_source is not None:
        roles["reward"] = RoleSpec(reward_source, head="scalar", trainable=False)
    return roles


def uses_reference(kl) -> bool:
    """A KL term exists: a coefficient above 0, or an adaptive controller (which starts from it)."""
    return kl.coef > 0 or kl.target is not None


def attention_for_rollouts(attn_implementation: str, packing: bool = False) -> str:
    """Left-padded prompts need an attention that reads the padding mask: the packing-only ones become sdpa, and
    with ppo.packing sdpa that also runs per-sample attention over a packed row (models/attention.py)."""
    if attn_implementation == SEGMENT_ATTENTION or attn_implementation in FLEX_IMPLEMENTATIONS:
        attn_implementation = "sdpa"
    if packing and attn_implementation == "sdpa":
        return PACKABLE_SDPA
    if packing and attn_implementation not in PACKED_ATTENTIONS:
        raise ConfigError(f"ppo.packing=true needs per-sample attention over a packed row (sdpa or flash-attention); "
                          f"the model runs {attn_implementation} attention (its family has no sdpa, or "
                          f"model.attn_implementation={attn_implementation}): set ppo.packing=false")
    return attn_implementation


def old_logps_from_update(p) -> bool:
    """`ppo` config -> whether the update's own forward gives the old log-probs: one optimizer step per rollout
    and the KL as a loss term (GRPO's usual setting), so the experience skips the actor's forward. Not with
    importance weights (they need π_old before the update, as TRL computes it) or the engine's old log-probs."""
    return (not p.kl.in_reward and p.epochs == 1 and p.critic.warmup_steps == 0
            and p.mini_batch_size == p.rollout.prompts_per_step * p.rollout.n_samples_per_prompt
            and importance_mode(p) is None and p.old_logprobs == "trainer")


def importance_mode(p) -> str | None:
    """ppo.importance_sampling.mode resolved: auto is TRL's sequence_mask with an engine of its own (vllm), nothing
    with hf (the sampler is the trainer's own forward) or with the engine's old log-probs (the weight would be 1)."""
    mode = p.importance_sampling.mode
    if mode == "auto":
        mode = "sequence_mask" if p.rollout.engine == "vllm" and p.old_logprobs == "trainer" else "none"
    return None if mode == "none" else mode


log = logging.getLogger(__name__)
CHAT_FORMATS = ("messages", "prompt")  # prompts rendered with the chat template (a `prompt` column of messages)


def stop_ids(cfg, source: ModelSource, tokenizer) -> list[int]:
    """The run's stop tokens, named in the log with what the neutral generation config overrides."""
    # tool calling renders every turn with the chat template: its replies end at the template's end of turn
    chat = (cfg.data.format in CHAT_FORMATS or uses_tools(cfg.ppo)) and getattr(tokenizer, "chat_template", None) \
        is not None
    stop = derive_stop_tokens(tokenizer, source.name_or_path, chat)
    log.info("stop tokens: %s", stop.describe(tokenizer))
    directory = Path(source.name_or_path or "")
    if source.name_or_path and (directory / "generation_config.json").is_file():
        overridden = checkpoint_overrides(GenerationConfig.from_pretrained(directory))
        if overridden:
            log.info("rollouts sample from softmax(logits / ppo.rollout.temperature) with the run's top-k/top-p "
                     "only; not applied from %s/generation_config.json: %s", directory,
                     ", ".join(f"{k}={v}" for k, v in sorted(overridden.items())))
    return list(stop.ids)


def reward_function_specs(reward) -> list[str]:
    """`ppo.reward.functions`, or the one-function shorthand `ppo.reward.function`."""
    return list(reward.functions) or ([reward.function] if reward.function else [])


def reward_sources(reward) -> list[RewardFunction]:
    """The reward functions, then the reward server as one more weighted source (its mean: `score_remote`)."""
    sources = load_reward_functions(reward_function_specs(reward), reward.weights)
    if reward.url is not None:
        server = RemoteReward(reward.url, batch_size=reward.url_batch_size, timeout_s=reward.url_timeout_s,
                              retries=reward.url_retries)
        sources.append(RewardFunction(reward.url, server, reward.url_weight, metric="score_remote"))
    return sources


def rollout_engine(cfg):
    """ppo.rollout.engine -> the engine that samples (stages/ppo/engines): hf, or vLLM servers."""
    rollout = cfg.ppo.rollout
    if rollout.engine == "hf":
        return HFEngine()
    from llmtrain.stages.ppo.engines.vllm import VLLMEngine, VLLMSettings
    from llmtrain.stages.ppo.engines.vllm_server import ServerSettings

    v = rollout.vllm
    precision = resolve_precision(cfg.precision, resolve_device(cfg.device))
    server = None if v.python is None else ServerSettings(
        python=v.python, precision=precision, max_model_len=cfg.data.max_seq_len, kv_cache_gib=v.kv_cache_gib,
        gpu_memory_utilization=v.gpu_memory_utilization, start_timeout_s=v.start_timeout_s, args=tuple(v.args))
    return VLLMEngine(VLLMSettings(urls=tuple(v.urls), server=server, run_dir=Path(cfg.output_dir), sleep=v.sleep,
                                   request_timeout_s=v.request_timeout_s, sync_tolerance=v.sync_tolerance,
                                   sync_dir=v.sync_dir))


def build(cfg, source: ModelSource, tokenizer, attn_implementation: str) -> PPOStage:
    p, t = cfg.ppo, cfg.trainer
    r, rollout = p.reward, p.rollout
    sampling = SamplingSettings(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                                top_p=rollout.top_p, top_k=rollout.top_k,
                                n_samples_per_prompt=rollout.n_samples_per_prompt, use_cache=rollout.use_cache,
                                batch_size=rollout.generation_batch_size)
    eval_sampling = SamplingSettings(max_new_tokens=rollout.eval_max_new_tokens or rollout.max_new_tokens,
                                     temperature=0.0, use_cache=rollout.use_cache,
                                     batch_size=rollout.generation_batch_size)
    attention = attention_for_rollouts(attn_implementation, p.packing)
    experience = ExperienceSettings(
        temperature=rollout.temperature, kl_estimator=p.kl.estimator, kl_in_reward=p.kl.in_reward,
        advantage=p.advantage, gamma=p.gamma, lam=p.lam, whiten_advantages=p.whiten_advantages,
        group_size=rollout.n_samples_per_prompt, micro_batch_size=t.micro_batch_size, scale_rewards=p.scale_rewards,
        mask_truncated=p.mask_truncated,
        old_logps_from_update=old_logps_from_update(p), packed_attention=attention if p.packing else None,
        old_logps_from_engine=p.old_logprobs == "engine",
        importance=None if importance_mode(p) is None else (importance_mode(p), p.importance_sampling.clip_max,
                                                             p.importance_sampling.clip_min))
    update = UpdateSettings(epochs=p.epochs, mini_batch_size=p.mini_batch_size, clip_eps=p.clip_eps,
                            value_clip_eps=p.value_clip_eps, value_coef=p.value_coef, entropy_coef=p.entropy_coef,
                            kl_in_loss=not p.kl.in_reward, kl_estimator=p.kl.estimator,
                            temperature=rollout.temperature, clip_eps_high=p.clip_eps_high,
                            clip_ratio_c=p.clip_ratio_c, ratio_level=p.ratio,
                            loss_agg=resolve_loss_agg(p.loss_agg, p.ratio), max_new_tokens=rollout.max_new_tokens)
    shaping = ScoreShaping(clip=r.clip, missing_eos_penalty=r.missing_eos_penalty, overlong_buffer=p.overlong.buffer,
                           overlong_penalty=p.overlong.penalty, max_new_tokens=rollout.max_new_tokens,
                           statistics=reward_model_statistics(r.model) if r.normalize else None)
    if r.normalize and shaping.statistics is None:
        raise ConfigError(f"ppo.reward.normalize=true: {r.model}/config.json has no reward_mean/reward_std (a reward "
                          "model trained by llmtrain's stage=reward exports them); set ppo.reward.normalize=false")
    engine, k = rollout_engine(cfg), p.off_policy.max_staleness  # k > 0: rollouts overlap training
    stage = PPOStage(ppo_roles(cfg, source), tokenizer, sampling=sampling, eval_sampling=eval_sampling,
                     experience=experience, update=update,
                     kl_controller=build_kl_controller(p.kl.coef, p.kl.target, p.kl.horizon),
                     shaping=shaping, reward_functions=reward_sources(r),
                     prompts_per_step=rollout.prompts_per_step, seed=t.seed,
                     stop_ids=stop_ids(cfg, source, tokenizer), attention=attention,
                     reward_model_weight=r.model_weight, critic_warmup_steps=p.critic.warmup_steps,
                     filter_max_rounds=p.filter_max_rounds if p.filter_groups else 0,
                     rollout_engine=engine, off_policy=AsyncRollouts(engine, k) if k else None)
    stage.name = cfg.stage.name
    attach_tools(stage, cfg, tokenizer)  # ppo.tools / ppo.environment: multi-turn rollouts (stages/ppo/tools)
    return stage


def rl_shape(cfg) -> RLShape:
    p, rollout = cfg.ppo, cfg.ppo.rollout
    return RLShape(samples=rollout.prompts_per_step * rollout.n_samples_per_prompt, mini_batch=p.mini_batch_size,
                   epochs=p.epochs, micro=cfg.trainer.micro_batch_size, on_policy=old_logps_from_update(p),
                   max_new_tokens=rollout.max_new_tokens, prompts_per_step=rollout.prompts_per_step,
                   samples_per_prompt=rollout.n_samples_per_prompt, token_loss=p.ratio == "token")


def max_prompt_len(cfg) -> int:
    return cfg.data.max_seq_len - cfg.ppo.rollout.max_new_tokens


def rl_spec(name: str) -> StageSpec:
    return StageSpec(name=name, build=build, roles=ppo_roles, data_formats=PROMPT_FORMATS,
                     data_hint="generates from prompts: data.format={format} must be prompt, prompt_response or "
                               "messages", count_name="samples", metric_group="ppo", config_node="ppo",
                     config_class=PPOConfig, problems=lambda cfg, dp: ppo_problems(cfg, name, dp), prompts=True,
                     max_prompt_len=max_prompt_len, rl_shape=rl_shape,
                     attention=lambda cfg, attn: attention_for_rollouts(attn, cfg.ppo.packing))


# GRPO is this stage with group-relative advantages and the KL as a loss term (conf/stage/grpo.yaml presets them)
STAGE_SPECS = (rl_spec("ppo"), rl_spec("grpo"))
