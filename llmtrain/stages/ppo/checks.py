"""The rules of ppo.* and what PPO needs from the rest of the config: every problem, each naming the field and
the fix, found before any model loads (the ppo and grpo specs' `problems`)."""

from __future__ import annotations

from typing import Any

from llmtrain.losses.advantages import (
    ADVANTAGE_ESTIMATORS,
    SCALE_REWARDS,
    needs_critic,
    needs_groups,
    needs_whitening,
)
from llmtrain.losses.kl import KL_ESTIMATORS
from llmtrain.losses.ppo import LOSS_AGGREGATIONS, RATIO_LEVELS, resolve_loss_agg
from llmtrain.parallel import degree_of
from llmtrain.stages.ppo.async_rollout import off_policy_problems
from llmtrain.stages.ppo.tools import environment_owns_reward, tool_problems

CRITIC_INITS = ("policy", "reward")
SEGMENT_ONLY_ATTENTION = ("sdpa_segments", "flex_segments")  # drop padding masks: wrong for left-padded prompts


def ppo_problems(cfg: Any, stage: str, dp: int) -> list[str]:
    p, d, m, t = cfg.ppo, cfg.data, cfg.model, cfg.trainer
    r, rollout, kl = p.reward, p.rollout, p.kl
    problems = _advantage_problems(p, stage)
    choices = {"ppo.advantage": (p.advantage, tuple(ADVANTAGE_ESTIMATORS)),
               "ppo.kl.estimator": (kl.estimator, tuple(KL_ESTIMATORS)),
               "ppo.critic.init": (p.critic.init, CRITIC_INITS), "ppo.scale_rewards": (p.scale_rewards, SCALE_REWARDS),
               "ppo.loss_agg": (resolve_loss_agg(p.loss_agg, p.ratio), LOSS_AGGREGATIONS),  # null: follows ppo.ratio
               "ppo.ratio": (p.ratio, RATIO_LEVELS)}
    problems += [f"{name}={value!r} is not one of {', '.join(allowed)}" for name, (value, allowed) in choices.items()
                 if value not in allowed]
    if d.packing:
        problems.append(f"stage {stage} generates from prompts, nothing is packed: set data.packing=false")
    if m.dropout > 0:
        problems.append(f"stage {stage} runs every forward without dropout (the first ratio must be exactly 1): "
                        f"model.dropout={m.dropout} must be 0")
    if cfg.peft.name == "lora" and cfg.peft.dropout > 0:
        problems.append(f"stage {stage} with peft=lora: the reference is the actor with its adapters off and every "
                        f"forward is without dropout: peft.dropout={cfg.peft.dropout} must be 0")
    if m.attn_implementation in SEGMENT_ONLY_ATTENTION:
        problems.append(f"stage {stage}: model.attn_implementation={m.attn_implementation} ignores padding masks, but "
                        "prompts are left-padded: use auto (sdpa, or flash-attention on a GPU) or sdpa")
    if p.packing and m.attn_implementation == "eager":
        problems.append("ppo.packing=true needs per-sample attention over a packed row: model.attn_implementation="
                        "eager has none; use auto or sdpa (or flash_attention_2 on a GPU), or ppo.packing=false")
    problems += _reward_function_problems(r, environment_owns_reward(p)) + tool_problems(p)
    if r.normalize and r.model is None:
        problems.append("ppo.reward.normalize=true uses a reward model's exported reward_mean/std: "
                        "set ppo.reward.model, "
                        "or ppo.reward.normalize=false")
    if r.clip is not None and not r.clip > 0:
        problems.append(f"ppo.reward.clip={r.clip} must be > 0 (or null)")
    if p.critic.warmup_steps < 0 or (p.critic.warmup_steps > 0 and not needs_critic.get(p.advantage, False)):
        problems.append(f"ppo.critic.warmup_steps={p.critic.warmup_steps}: iterations that train the critic alone; "
                        f"must be >= 0, and 0 without a critic (ppo.advantage={p.advantage})")
    if needs_critic.get(p.advantage) and p.critic.init == "reward" and r.model is None:
        problems.append("ppo.critic.init=reward starts the critic from the reward model: set ppo.reward.model, or "
                        "ppo.critic.init=policy")
    if p.filter_groups and (rollout.n_samples_per_prompt < 2 or p.filter_max_rounds < 1):
        problems.append(f"ppo.filter_groups=true drops the groups whose scores all agree: it needs "
                        f"ppo.rollout.n_samples_per_prompt >= 2 (is {rollout.n_samples_per_prompt}) and "
                        f"ppo.filter_max_rounds >= 1 (is {p.filter_max_rounds})")
    problems += _batch_problems(p, t, dp)
    problems += _engine_problems(p)
    problems += off_policy_problems(p)  # ppo.off_policy: stages/ppo/async_rollout.py
    problems += _value_problems(p, rollout, kl)
    if rollout.max_new_tokens >= d.max_seq_len:
        problems.append(f"ppo.rollout.max_new_tokens={rollout.max_new_tokens} leaves no room for a prompt in "
                        f"data.max_seq_len={d.max_seq_len}: raise data.max_seq_len")
    tp = degree_of(cfg.backend, "tp")
    if tp > 1:
        problems.append(f"stage {stage} with backend.tp={tp}: generation under tensor parallelism is not "
                        f"supported yet; use backend.tp=1 (backend={cfg.backend.name})")
    if t.grad_accum_steps != 1:
        problems.append(f"stage {stage}: a mini-batch is one optimizer step (ppo.mini_batch_size sequences, global); "
                        f"trainer.grad_accum_steps={t.grad_accum_steps} must be 1")
    return problems


def _advantage_problems(p: Any, stage: str) -> list[str]:
    """What ppo.advantage's estimator needs: no critic under stage=grpo, groups, its scale or its whitening."""
    problems, n = [], p.rollout.n_samples_per_prompt
    if stage == "grpo" and needs_critic.get(p.advantage, False):
        critic_free = ", ".join(name for name, critic in needs_critic.items() if not critic)
        problems.append(f"stage=grpo trains no critic: ppo.advantage={p.advantage!r} must be one of {critic_free} "
                        "(or use stage=ppo for gae with a critic)")
    if needs_groups.get(p.advantage) and n < 2:
        problems.append(f"ppo.advantage={p.advantage} compares the samples of a prompt: "
                        f"ppo.rollout.n_samples_per_prompt={n} must be >= 2")
    if p.scale_rewards != "group" and p.advantage != "grpo":
        problems.append(f"ppo.scale_rewards={p.scale_rewards} scales grpo's advantages; ppo.advantage={p.advantage} "
                        "has none to scale: leave ppo.scale_rewards=group")
    if needs_whitening.get(p.advantage) and not p.whiten_advantages:
        problems.append(f"ppo.advantage={p.advantage} (REINFORCE++) is normalised only by whitening its advantages "
                        "over the global batch, as OpenRLHF and verl do; ppo.whiten_advantages=false (stage=grpo's "
                        "preset) would train on the raw returns: set ppo.whiten_advantages=true")
    return problems


def _reward_function_problems(r: Any, environment_reward: bool = False) -> list[str]:
    """Exactly one source of scores; functions as module:attribute, one weight each."""
    problems, functions = [], list(r.functions)
    if r.function is not None and functions:
        problems.append(f"set ppo.reward.function (one) or ppo.reward.functions (several), not both; got "
                        f"function={r.function!r}, functions={functions}")
    specs = functions or ([r.function] if r.function is not None else [])
    if r.model is None and not specs and r.url is None and not environment_reward:  # get_reward: a source
        problems.append("set ppo.reward.model (a reward model directory), ppo.reward.function (module:attribute; "
                        "several: ppo.reward.functions=[...]), ppo.reward.url (a reward server), or several")
    problems += _reward_server_problems(r)
    if r.model is not None and specs and r.normalize:
        problems.append("ppo.reward.normalize=true normalises a reward model's score alone (its exported mean/std), "
                        "not a sum with reward functions: set ppo.reward.normalize=false, or drop the functions")
    key = "ppo.reward.functions" if functions else "ppo.reward.function"
    named = "{key}: {spec!r}" if functions else "{key}={spec!r}"
    problems += [f"{named.format(key=key, spec=spec)} must be module:attribute (e.g. my_rewards:score)"
                 for spec in specs if ":" not in spec]
    if r.weights is not None and len(r.weights) != len(specs):
        problems.append(f"ppo.reward.weights has {len(r.weights)} values for {len(specs)} reward function(s) ({key}): "
                        "give one weight per function, or drop ppo.reward.weights (1 each)")
    return problems


def _reward_server_problems(r: Any) -> list[str]:
    if r.url is None:
        return []
    problems = []
    if not str(r.url).startswith(("http://", "https://")):
        problems.append(f"ppo.reward.url={r.url!r} must be an http:// or https:// URL (e.g. http://10.0.0.5:5000/"
                        "get_reward)")
    if r.url_batch_size < 1:
        problems.append(f"ppo.reward.url_batch_size={r.url_batch_size} must be >= 1 (responses per request)")
    if not r.url_timeout_s > 0:
        problems.append(f"ppo.reward.url_timeout_s={r.url_timeout_s} must be > 0 seconds: an unbounded request could "
                        "hang the run")
    if r.url_retries < 0:
        problems.append(f"ppo.reward.url_retries={r.url_retries} must be >= 0")
    if r.normalize and r.model is not None:
        problems.append("ppo.reward.normalize=true normalises a reward model's score alone, not a sum with a reward "
                        "server's: set ppo.reward.normalize=false, or drop ppo.reward.url")
    return problems


def _batch_problems(p: Any, t: Any, dp: int) -> list[str]:
    rollout, problems = p.rollout, []
    samples = rollout.prompts_per_step * rollout.n_samples_per_prompt
    if rollout.prompts_per_step < 1 or rollout.prompts_per_step % dp:
        problems.append(f"ppo.rollout.prompts_per_step={rollout.prompts_per_step} must be a positive multiple of the "
                        f"data-parallel size {dp} (each rank generates for its share)")
    if p.mini_batch_size < 1 or p.mini_batch_size % dp or samples % max(p.mini_batch_size, 1):
        problems.append(f"ppo.mini_batch_size={p.mini_batch_size} must be a multiple of the data-parallel size {dp} "
                        f"and divide the {samples} samples of a step (prompts_per_step × n_samples_per_prompt)")
    if p.epochs < 1:
        problems.append(f"ppo.epochs={p.epochs} must be >= 1")
    return problems


def _value_problems(p: Any, rollout: Any, kl: Any) -> list[str]:
    problems = []
    if not rollout.temperature > 0:
        problems.append(f"ppo.rollout.temperature={rollout.temperature} must be > 0 (log-probs divide by it; the "
                        "held-out eval is greedy already)")
    if not 0 < rollout.top_p <= 1:
        problems.append(f"ppo.rollout.top_p={rollout.top_p} must be in (0, 1]")
    if not 0 <= p.overlong.buffer < rollout.max_new_tokens or p.overlong.penalty < 0:
        problems.append(f"ppo.overlong.buffer={p.overlong.buffer} must be in [0, ppo.rollout.max_new_tokens="
                        f"{rollout.max_new_tokens}) and ppo.overlong.penalty={p.overlong.penalty} >= 0")
    if rollout.generation_batch_size < 0:
        problems.append(f"ppo.rollout.generation_batch_size={rollout.generation_batch_size} must be >= 0 (0: a rank's "
                        "sequences in one generate call)")
    if rollout.top_k < 0 or rollout.max_new_tokens < 1 or rollout.n_samples_per_prompt < 1:
        problems.append("ppo.rollout.top_k must be >= 0, max_new_tokens and n_samples_per_prompt >= 1 "
                        f"(got {rollout.top_k}, {rollout.max_new_tokens}, {rollout.n_samples_per_prompt})")
    if p.clip_eps_high is not None and not p.clip_eps_high > 0:
        problems.append(f"ppo.clip_eps_high={p.clip_eps_high} must be > 0 (or null: ppo.clip_eps)")
    if p.clip_ratio_c is not None and not p.clip_ratio_c > 1:
        problems.append(f"ppo.clip_ratio_c={p.clip_ratio_c} must be > 1 (dual-clip caps −A·ρ at −A·c; 3 is usual) "
                        "or null")
    if not p.clip_eps > 0 or (p.value_clip_eps is not None and not p.value_clip_eps > 0):
        problems.append(f"ppo.clip_eps={p.clip_eps} and ppo.value_clip_eps={p.value_clip_eps} must be > 0 "
                        "(value_clip_eps may be null: no value clipping)")
    if not (0 <= p.gamma <= 1 and 0 <= p.lam <= 1):
        problems.append(f"ppo.gamma={p.gamma} and ppo.lam={p.lam} must be in [0, 1]")
    if kl.coef < 0 or p.entropy_coef < 0 or p.value_coef <= 0:
        problems.append(f"ppo.kl.coef={kl.coef} and ppo.entropy_coef={p.entropy_coef} must be >= 0, ppo.value_coef="
                        f"{p.value_coef} > 0")
    if kl.target is not None and not kl.target > 0:
        problems.append(f"ppo.kl.target={kl.target} must be > 0 (or null: a fixed coefficient)")
    if kl.target is not None and kl.coef == 0:
        problems.append(f"ppo.kl.target={kl.target}: the adaptive controller scales ppo.kl.coef, which is 0 and would "
                        "stay 0; set an initial ppo.kl.coef > 0 (e.g. 0.05)")
    if not kl.in_reward and kl.estimator == "k1" and (kl.coef > 0 or kl.target is not None):
        problems.append("ppo.kl.estimator=k1 as a loss term (ppo.kl.in_reward=false): the gradient of log π − log ref "
                        "averages to zero on samples of π, so nothing would pull the policy towards the reference; "
                        "use ppo.kl.estimator=k3 (GRPO's) or k2, or ppo.kl.in_reward=true")
    if kl.horizon < 1:
        problems.append(f"ppo.kl.horizon={kl.horizon} must be >= 1")
    for role in ("actor", "critic"):
        lr = getattr(p, role).lr
        if lr is not None and not lr > 0:
            problems.append(f"ppo.{role}.lr={lr} must be > 0 (or null: optim.lr)")
    return problems


OLD_LOGPROBS = ("trainer", "engine")


def _engine_problems(p: Any) -> list[str]:
    """ppo.rollout.engine, its vllm node, ppo.old_logprobs and ppo.importance_sampling."""
    from llmtrain.losses.importance import IMPORTANCE_SAMPLING_MODES
    from llmtrain.stages.ppo.engines import ROLLOUT_ENGINES

    rollout, v, sampling = p.rollout, p.rollout.vllm, p.importance_sampling
    problems = [f"{name}={value!r} is not one of {', '.join(allowed)}" for name, value, allowed in (
        ("ppo.rollout.engine", rollout.engine, ROLLOUT_ENGINES), ("ppo.old_logprobs", p.old_logprobs, OLD_LOGPROBS),
        ("ppo.importance_sampling.mode", sampling.mode, ("auto", "none", *IMPORTANCE_SAMPLING_MODES)))
        if value not in allowed]
    if sampling.clip_max is not None and sampling.clip_min is not None and not sampling.clip_min < sampling.clip_max:
        problems.append(f"ppo.importance_sampling.clip_min={sampling.clip_min} must be below clip_max="
                        f"{sampling.clip_max}")
    if sampling.off_policy_mask_threshold is not None:
        problems.append("ppo.importance_sampling.off_policy_mask_threshold is not supported yet (it needs each "
                        "sequence's KL inside the fused head's chunks): leave it null")
    if p.old_logprobs == "engine" and sampling.mode not in ("auto", "none"):
        problems.append(f"ppo.importance_sampling.mode={sampling.mode} weighs π_old / π_engine, which is 1 with "
                        "ppo.old_logprobs=engine: set ppo.importance_sampling.mode=none, or ppo.old_logprobs=trainer")
    if rollout.engine != "vllm":
        if v.urls or v.python:
            problems.append(f"ppo.rollout.vllm.urls / python are set but ppo.rollout.engine={rollout.engine}: set "
                            "ppo.rollout.engine=vllm to sample with them, or drop them")
        return problems
    if bool(v.urls) == (v.python is not None):
        problems.append("ppo.rollout.engine=vllm needs exactly one of ppo.rollout.vllm.urls=[http://host:port, ...] "
                        "(servers you run) or ppo.rollout.vllm.python=PATH (the engine environment's interpreter, "
                        "built by `bash launch/vllm_env.sh`: llmtrain starts the server)")
    problems += [f"ppo.rollout.vllm.urls: {url!r} must start with http:// or https://" for url in v.urls
                 if not str(url).startswith(("http://", "https://"))]
    if not rollout.use_cache or rollout.generation_batch_size:
        problems.append("ppo.rollout.use_cache=false and ppo.rollout.generation_batch_size apply to the hf engine; "
                        "vLLM schedules its own batches with its paged KV cache: leave them at true and 0")
    if not 0 < v.gpu_memory_utilization <= 1 or v.kv_cache_gib <= 0 or v.sync_tolerance < 0:
        problems.append(f"ppo.rollout.vllm.gpu_memory_utilization={v.gpu_memory_utilization} must be in (0, 1], "
                        f"kv_cache_gib={v.kv_cache_gib} > 0 and sync_tolerance={v.sync_tolerance} >= 0")
    return problems
