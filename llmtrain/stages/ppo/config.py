"""stage=ppo / stage=grpo: the `ppo` config node (its rules: stages/ppo/checks.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class PPORoleConfig:
    lr: Optional[float] = None  # the role's peak lr; null: optim.lr (the schedule and the rest of optim are shared)


@dataclass
class PPOCriticConfig(PPORoleConfig):
    init: str = "policy"  # policy: the actor's weights with a fresh value head | reward: ppo.reward.model, head kept
    warmup_steps: int = 0  # the first iterations update only the critic (OpenRLHF's freezing_actor_steps)


@dataclass
class PPORewardConfig:
    """`model` (a reward model directory: a frozen role), `function`/`functions` (`module:attribute`), or both
    (scores summed: the functions with `weights`, the model with `model_weight`)."""
    model: Optional[str] = None
    model_weight: float = 1.0  # the reward model's weight when reward functions are set too
    # score(prompts, responses, **columns) -> list[float], or a function written for TRL
    function: Optional[str] = None
    functions: List[str] = field(default_factory=list)  # several, summed with `weights` (TRL's reward_funcs)
    weights: Optional[List[float]] = None  # one per function (TRL's reward_weights); null: 1 each
    clip: Optional[float] = None  # scores clipped to [-clip, clip]
    normalize: bool = False  # (score - reward_mean) / reward_std with the reward model's exported statistics
    missing_eos_penalty: Optional[float] = None  # added to the score of a response that ended without EOS
    # a reward server (OpenRLHF's --remote_rm_url): responses POSTed as JSON, {"rewards": [...]} back
    # (stages/ppo/remote_reward.py), summed with the functions and the model at `url_weight`
    url: Optional[str] = None
    url_weight: float = 1.0  # its scores' weight in the sum (like reward.weights for functions)
    url_batch_size: int = 64  # responses per request
    url_timeout_s: float = 60.0  # one request; connection errors, timeouts and HTTP 5xx are retried
    url_retries: int = 2  # further tries of a request that failed to connect, timed out or answered 5xx


@dataclass
class PPOVLLMConfig:
    """ppo.rollout.engine=vllm: a vLLM server in its own environment, reached over HTTP on its token-in, token-out
    endpoint. `urls` (servers the user runs; the ranks split their prompts over them) or `python` (the engine
    environment's interpreter: llmtrain starts one server on 127.0.0.1 and stops it at the end and on every failure)."""
    urls: List[str] = field(default_factory=list)
    python: Optional[str] = None  # e.g. .cache/vllm-env/bin/python (launch/vllm_env.sh builds it)
    # passed to the server llmtrain starts (--tensor-parallel-size 2, ...); with urls: what your servers run with (the
    # planner reads their tensor / data parallel sizes from it)
    args: List[str] = field(default_factory=list)
    sleep: bool = False  # colocated on the training GPUs: /sleep while the trainer updates, /wake_up to sample
    kv_cache_gib: int = 1  # CPU engine: VLLM_CPU_KVCACHE_SPACE in GiB (vLLM's default takes most of the machine)
    gpu_memory_utilization: float = 0.9  # GPU engine: the share of each engine GPU vLLM takes (weights + KV cache)
    start_timeout_s: float = 600.0  # a started server must answer /health within this
    request_timeout_s: float = 600.0  # one generate or sync request
    sync_tolerance: float = 1e-3  # the probe's max |log p engine - log p trainer| after a sync; past it the run stops
    sync_dir: Optional[str] = None  # where a sync writes the weights; null: /dev/shm when writable, else the run dir


@dataclass
class PPOImportanceSamplingConfig:
    """The train-inference mismatch correction (TRL 1.16's vllm_importance_sampling_*; verl's TIS): the update's
    per-token loss weighted by π_old / π_engine (token or sequence level), truncated at `clip_max` or masked outside
    [clip_min, clip_max]."""
    mode: str = "auto"  # auto (sequence_mask with engine=vllm, none with hf) | none | token_truncate | token_mask |
    #                     sequence_truncate | sequence_mask
    clip_max: Optional[float] = 3.0  # C_max (TRL's vllm_importance_sampling_clip_max)
    clip_min: Optional[float] = None  # C_min (TRL's vllm_importance_sampling_clip_min)
    off_policy_mask_threshold: Optional[float] = None  # TRL's: sequences whose mean KL(old || engine) exceeds it and
    #                                                    whose advantage is negative train nothing


@dataclass
class PPOOffPolicyConfig:
    """Rollouts that overlap training (ppo.rollout.engine=vllm; stages/ppo/async_rollout.py): the next iterations'
    rollouts are requested before the current one trains, and corrected as decoupled PPO (ppo.importance_sampling)."""
    max_staleness: int = 0  # k: policy versions (one per iteration) a rollout may lag; 0: on-policy, nothing overlaps


@dataclass
class PPORolloutConfig:
    engine: str = "hf"  # hf: the training model's own forward (a lean sampling loop) | vllm: ppo.rollout.vllm
    vllm: PPOVLLMConfig = field(default_factory=PPOVLLMConfig)
    prompts_per_step: int = 16  # global, per iteration (trainer.max_steps counts iterations)
    n_samples_per_prompt: int = 1  # GRPO: the group size (>= 2)
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    use_cache: bool = True  # the KV cache during generation (the benchmark measures without it)
    generation_batch_size: int = 0  # sequences per generate call on each rank (bounds the KV cache); 0: all at once
    eval_max_new_tokens: Optional[int] = None  # greedy held-out generation; null: max_new_tokens


@dataclass
class PPOKLConfig:
    coef: float = 0.05  # β
    estimator: str = "k1"  # k1 | k2 | k3 (Schulman): per-token estimate of KL(π || π_ref)
    in_reward: bool = True  # true: r_t -= β·KL_t (PPO); false: β·KL as a loss term (GRPO)
    target: Optional[float] = None  # adaptive controller (Ziegler et al.): the per-sequence KL to hold
    horizon: int = 10000  # samples over which the adaptive coefficient moves


@dataclass
class PPOOverlongConfig:
    buffer: int = 0  # DAPO's soft overlong punishment over the last `buffer` of max_new_tokens; 0: off
    penalty: float = 1.0  # the score lost by a response that reaches max_new_tokens


@dataclass
class PPOConfig:
    """stage=ppo / stage=grpo: one trainer step = one rollout + ppo.epochs passes over it in mini-batches."""
    actor: PPORoleConfig = field(default_factory=PPORoleConfig)
    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)
    reward: PPORewardConfig = field(default_factory=PPORewardConfig)
    rollout: PPORolloutConfig = field(default_factory=PPORolloutConfig)
    kl: PPOKLConfig = field(default_factory=PPOKLConfig)
    overlong: PPOOverlongConfig = field(default_factory=PPOOverlongConfig)
    mask_truncated: bool = False  # a response cut at max_new_tokens trains nothing (TRL's mask_truncated_completions)
    # DAPO's dynamic sampling: a group whose scores all agree (no advantage) is dropped and the batch refilled with
    # groups of the next prompts, generating at most `filter_max_rounds` batches of prompts per iteration
    filter_groups: bool = False
    filter_max_rounds: int = 3
    # gae (critic) | grpo | rloo | reinforce_pp | reinforce_pp_baseline (OpenRLHF's) | reinforce_pp_baseline_verl
    # (verl's) (no critic); the reinforce_pp ones need whiten_advantages=true (REINFORCE++ is normalised by it)
    advantage: str = "gae"
    scale_rewards: str = "group"  # grpo: divide by the group's std | batch: the batch's | none (Dr. GRPO)
    # token_mean | seq_mean_token_mean | seq_mean_token_sum | dr_grpo (TRL's: Σ / (B·max_new_tokens)) |
    # seq_mean_token_sum_norm (verl's: Σ / max_new_tokens); null: seq_mean_token_mean with ratio=sequence (GSPO), else
    # token_mean (losses/ppo.aggregation_weights has the formulas)
    loss_agg: Optional[str] = None
    ratio: str = "token"  # token | sequence (GSPO: the sequence's mean log-ratio)
    # padding-free experience and update forwards (OpenRLHF's packing_samples): each micro-batch's sequences, prompt
    # and response without padding, in one row with per-sample attention; generation is unchanged
    packing: bool = False
    epochs: int = 1
    mini_batch_size: int = 16  # sequences per optimizer step, global
    clip_eps: float = 0.2  # ε_low, and ε_high unless clip_eps_high
    clip_eps_high: Optional[float] = None  # DAPO's clip-higher (e.g. 0.28); null: clip_eps
    clip_ratio_c: Optional[float] = None  # dual-clip: the loss of a negative advantage capped at −A·c (c > 1)
    value_clip_eps: Optional[float] = 0.2  # null: unclipped value loss
    value_coef: float = 1.0  # the critic's loss scale (its own optimizer: only its lr-relative size matters)
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    # the old log-probs of the ratio: trainer (the actor's forward before the update) | engine (the sampler's own)
    old_logprobs: str = "trainer"
    importance_sampling: PPOImportanceSamplingConfig = field(default_factory=PPOImportanceSamplingConfig)
    # multi-turn rollouts with tools (stages/ppo/tools; docs/rl/environments.md), TRL's `tools` and
    # `environment_factory` as module:attribute
    tools: List[str] = field(default_factory=list)  # tool functions, module:function (type hints + docstring)
    environment: Any = None  # module:factory, or a dict name -> module:factory chosen by each row's `environment`
    tool_timeout_s: float = 30.0  # a tool call still running after this answers {"error": ...} (TRL has no limit)
    max_tool_calling_iterations: Optional[int] = None  # rounds of tool calls per trajectory (TRL's); null: no limit
    max_tokens_per_turn: Optional[int] = None  # one model turn's tokens; null: what is left of max_new_tokens
    off_policy: PPOOffPolicyConfig = field(default_factory=PPOOffPolicyConfig)
