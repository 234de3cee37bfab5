"""Typed config schema (Hydra structured configs) and validation that needs no model weights.

Every check here runs on every rank before any model loads; all problems are collected and raised
together as one ConfigError whose lines each name the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


@dataclass
class TrainerConfig:
    max_steps: int = 100
    seed: int = 1234
    micro_batch_size: int = 8  # per rank
    grad_accum_steps: int = 1
    global_batch_size: Optional[int] = None  # when set: must equal micro × accum × dp
    eval_every_n_steps: int = 0  # 0: evaluate only after the last step
    eval_batch_size: Optional[int] = None  # default: micro_batch_size
    log_every_n_steps: int = 10  # console only; metrics.jsonl gets every step
    save_every_n_steps: int = 0  # 0: save only after the last step
    keep_last_k: int = 2
    skip_nonfinite: bool = False
    collective_timeout_s: int = 600


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0  # 0 = no clipping (the norm is still reported)


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = None  # local directory or hub id
    from_config: Optional[Dict[str, Any]] = None  # {model_type: llama, hidden_size: ..., ...}
    config_path: Optional[str] = None  # a shipped config.json: validates a hub id offline
    tokenizer: Optional[str] = None  # default: the model directory
    attn_implementation: str = "auto"  # auto: flash_attention_2 on GPU when installed, else flex_segments on GPU,
    # sdpa_segments on CPU
    activation_checkpointing: bool = False
    dropout: float = 0.0
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    train_files: List[str] = field(default_factory=list)
    eval_files: List[str] = field(default_factory=list)
    eval_fraction: float = 0.0
    dataset: Optional[str] = None
    split: str = "train"
    eval_split: Optional[str] = None
    format: str = "text"  # text | prompt_response | alpaca | messages
    max_seq_len: int = 512
    packing: bool = False
    overlong: str = "truncate"  # truncate | drop | chunk (text only: a long text becomes several rows)
    num_workers: int = 0
    group_by_length: bool = False  # batches of similar lengths: less padding, less random order


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "llmtrain"
    name: Optional[str] = None
    dir: Optional[str] = None  # default: the run dir
    mode: Optional[str] = None  # null respects WANDB_MODE; online | offline
    entity: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class OffloadConfig:
    device: str = "none"  # none | cpu | nvme
    nvme_path: Optional[str] = None
    pin_memory: bool = True


@dataclass
class BackendConfig:
    name: str = "ddp"  # ddp | deepspeed | fsdp2
    # DeepSpeed (presets deepspeed, zero0..zero3, zero3_offload)
    zero_stage: int = 0
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    # Sizes in elements, "auto" or an int. "auto" follows the model's hidden size h, as transformers'
    # DeepSpeed integration does: reduce bucket h², ZeRO-3 prefetch 0.9·h², persistence threshold 10·h
    # (ZeRO-3 keeps weights up to that size whole on every rank). Typed Any: OmegaConf has no int | str.
    reduce_bucket_size: Any = "auto"
    # Only chunks all-gathers when torch lacks all_gather_into_tensor: DeepSpeed 0.19 ignores it otherwise.
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: Any = "auto"
    stage3_param_persistence_threshold: Any = "auto"
    stage3_max_live_parameters: int = 1_000_000_000
    # {DeepSpeed key: value} for keys we do not model, deep-merged last. Typed Any, default null: then
    # `backend.ds_config_overrides={...}` assigns the dict (a Dict field would refuse every new key in
    # struct mode); the deepspeed check rejects anything but a mapping.
    ds_config_overrides: Any = None
    # FSDP2 (presets fsdp2, fsdp2_tp): world = dp_replicate × dp_shard × tp; dp_shard -1 = infer
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    compile: bool = False


@dataclass
class StageConfig:
    name: str = "pretrain"  # pretrain | sft | reward | dpo | ppo | grpo


@dataclass
class RewardConfig:
    """stage=reward: pairwise loss -logsigmoid(r_chosen - r_rejected - margin) + center_coef·(r_c + r_r)²."""
    margin_column: Optional[str] = None  # a data column with a per-pair margin (null: no margin)
    center_coef: float = 0.0  # > 0 pulls the rewards' mean towards 0 (Eisenstein et al.; TRL's center_rewards)


@dataclass
class DPOConfig:
    """stage=dpo: policy vs a frozen reference on the summed response log-probs of each pair."""
    beta: float = 0.1
    loss: str = "sigmoid"  # sigmoid (DPO) | ipo
    label_smoothing: float = 0.0  # > 0: conservative DPO (cDPO), the labels flipped with this probability


@dataclass
class PPORoleConfig:
    lr: Optional[float] = None  # the role's peak lr; null: optim.lr (the schedule and the rest of optim are shared)


@dataclass
class PPOCriticConfig(PPORoleConfig):
    init: str = "policy"  # policy: the actor's weights with a fresh value head | reward: ppo.reward.model, head kept


@dataclass
class PPORewardConfig:
    """Exactly one of `model` (a reward model directory: a frozen role) and `function` (`module:attribute`)."""
    model: Optional[str] = None
    function: Optional[str] = None  # score(prompts, responses, **columns) -> list[float]
    clip: Optional[float] = None  # scores clipped to [-clip, clip]
    normalize: bool = False  # (score - reward_mean) / reward_std with the reward model's exported statistics
    missing_eos_penalty: Optional[float] = None  # added to the score of a response that ended without EOS


@dataclass
class PPORolloutConfig:
    prompts_per_step: int = 16  # global, per iteration (trainer.max_steps counts iterations)
    n_samples_per_prompt: int = 1  # GRPO: the group size (>= 2)
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    use_cache: bool = True  # the KV cache during generation (the benchmark measures without it)
    eval_max_new_tokens: Optional[int] = None  # greedy held-out generation; null: max_new_tokens


@dataclass
class PPOKLConfig:
    coef: float = 0.05  # β
    estimator: str = "k1"  # k1 | k2 | k3 (Schulman): per-token estimate of KL(π || π_ref)
    in_reward: bool = True  # true: r_t -= β·KL_t (PPO); false: β·KL as a loss term (GRPO)
    target: Optional[float] = None  # adaptive controller (Ziegler et al.): the per-sequence KL to hold
    horizon: int = 10000  # samples over which the adaptive coefficient moves


@dataclass
class PPOConfig:
    """stage=ppo / stage=grpo: one trainer step = one rollout + ppo.epochs passes over it in mini-batches."""
    actor: PPORoleConfig = field(default_factory=PPORoleConfig)
    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)
    reward: PPORewardConfig = field(default_factory=PPORewardConfig)
    rollout: PPORolloutConfig = field(default_factory=PPORolloutConfig)
    kl: PPOKLConfig = field(default_factory=PPOKLConfig)
    advantage: str = "gae"  # gae (critic) | grpo (group-relative, no critic)
    epochs: int = 1
    mini_batch_size: int = 16  # sequences per optimizer step, global
    clip_eps: float = 0.2
    value_clip_eps: Optional[float] = 0.2  # null: unclipped value loss
    value_coef: float = 1.0  # the critic's loss scale (its own optimizer: only its lr-relative size matters)
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True


@dataclass
class PeftConfig:
    """peft=lora: low-rank adapters (the peft library) on the trainable roles; the base stays frozen."""
    name: str = "none"  # none | lora
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # "all-linear" (every Linear but the output layer) or a list of module names (q_proj, v_proj, ...).
    # Typed Any: OmegaConf has no str | list.
    target_modules: Any = "all-linear"
    # Modules trained in full next to the adapters; null: the stage decides (a reward model's score head).
    modules_to_save: Optional[List[str]] = None
    # QLoRA: the frozen base loaded in 4 bits (bitsandbytes NF4, bf16 compute); a CUDA GPU, backend=ddp only.
    load_in_4bit: bool = False


@dataclass
class PlanConfig:
    """`python -m llmtrain.plan` (and dry_run=true): the cluster to predict cost on; the run's `device` is untouched."""
    world_size: Optional[int] = None  # ranks to plan for; null: the current world (WORLD_SIZE, else 1)
    gpu: Optional[str] = None  # a100-40gb | a100-80gb | h100-80gb | h200 | rtx-4090 | cpu | any name with the two below;
    # null: this machine's device
    peak_tflops: Optional[float] = None  # dense 16-bit peak per device (overrides the table's)
    memory_gb: Optional[float] = None  # device memory in GiB (overrides the table's)
    link_gb_per_s: Optional[float] = None  # per-rank collective bandwidth, GB/s one way (overrides the table's)
    mfu: float = 0.4  # compute efficiency the step time assumes (model FLOPs / peak while computing)
    compare_backends: bool = False  # one table, a row per backend (ddp, zero1..3, zero3_offload, fsdp2, fsdp2_tp)


@dataclass
class RunConfig:
    recipe: str = ""
    output_dir: Optional[str] = None  # default: runs/<recipe>
    resume: Optional[str] = None  # auto | PATH (a run dir or one step folder) | null
    dry_run: bool = False
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    device: str = "auto"  # auto | cpu | cuda
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    stage: StageConfig = field(default_factory=StageConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def register_schema() -> None:
    ConfigStore.instance().store(name="schema", node=RunConfig)


CHOICES = {
    "precision": ("auto", "fp32", "bf16", "fp16"),
    "device": ("auto", "cpu", "cuda"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "data.format": ("text", "prompt_response", "alpaca", "messages", "preference", "prompt"),
    "data.overlong": ("truncate", "drop", "chunk"),
    "backend.name": ("ddp", "deepspeed", "fsdp2"),
    "stage.name": ("pretrain", "sft", "reward", "dpo", "ppo", "grpo"),
    "dpo.loss": ("sigmoid", "ipo"),
    "ppo.advantage": ("gae", "grpo"),
    "ppo.kl.estimator": ("k1", "k2", "k3"),
    "ppo.critic.init": ("policy", "reward"),
    "peft.name": ("none", "lora"),
}
SFT_FORMATS = ("prompt_response", "alpaca", "messages")
PAIR_STAGES = ("reward", "dpo")
RL_STAGES = ("ppo", "grpo")  # one stage: grpo presets ppo.advantage=grpo (conf/stage/grpo.yaml)
PROMPT_FORMATS = ("prompt", "prompt_response", "messages")  # where an RL stage finds its prompts


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def config_problems(cfg: Any, world_size: int) -> list[str]:
    """Every problem with the config that can be found without the model or the data."""
    problems = []
    for name, allowed in CHOICES.items():
        value = _get(cfg, name)
        if value not in allowed:
            problems.append(f"{name}={value!r} is not one of {', '.join(allowed)}")
    t, o, d, m = cfg.trainer, cfg.optim, cfg.data, cfg.model
    positive = {"trainer.max_steps": t.max_steps, "trainer.micro_batch_size": t.micro_batch_size,
                "trainer.grad_accum_steps": t.grad_accum_steps, "data.max_seq_len": d.max_seq_len,
                "trainer.keep_last_k": t.keep_last_k, "trainer.collective_timeout_s": t.collective_timeout_s}
    problems += [f"{k}={v} must be >= 1" for k, v in positive.items() if v < 1]
    non_negative = {"trainer.eval_every_n_steps": t.eval_every_n_steps, "trainer.save_every_n_steps":
                    t.save_every_n_steps, "trainer.log_every_n_steps": t.log_every_n_steps,
                    "optim.warmup_steps": o.warmup_steps, "optim.max_grad_norm": o.max_grad_norm,
                    "optim.weight_decay": o.weight_decay, "data.num_workers": d.num_workers}
    problems += [f"{k}={v} must be >= 0" for k, v in non_negative.items() if v < 0]
    if not o.lr > 0:
        problems.append(f"optim.lr={o.lr} must be > 0")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.append(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    if not 0 <= o.min_lr_ratio <= 1:
        problems.append(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if m.attn_implementation.startswith("flash_attention") and cfg.precision == "fp32":
        problems.append(f"model.attn_implementation={m.attn_implementation} runs in bf16/fp16 only, but precision=fp32: "
                        "use precision=bf16 (or auto on a GPU), or model.attn_implementation=auto")
    if m.attn_implementation in ("flex_segments", "flex_attention") and m.dropout > 0:  # models/flex.py
        problems.append(f"model.attn_implementation={m.attn_implementation} has no attention dropout, but "
                        f"model.dropout={m.dropout}: use model.dropout=0, or sdpa_segments")
    if not 0 <= m.dropout < 1:
        problems.append(f"model.dropout={m.dropout} must be in [0, 1)")
    if not 0 <= d.eval_fraction < 1:
        problems.append(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
    problems += _batch_problems(t, data_parallel_size=data_parallel_size(cfg.backend, world_size))
    problems += _source_problems(cfg)
    problems += backend_config_problems(cfg.backend, world_size)
    problems += stage_problems(cfg, data_parallel_size(cfg.backend, world_size))
    from llmtrain.models.lora_checks import peft_problems, qlora_problems

    problems += peft_problems(cfg.peft, cfg.backend, cfg.stage.name)
    problems += qlora_problems(cfg)
    return problems


OUTPUT_LAYERS = ("lm_head",)  # never a LoRA target: peft's all-linear leaves it out too
# Stages whose frozen reference is, under peft=lora, the policy with its adapters disabled (RoleSpec.adapter_off_of).
ADAPTER_REFERENCE_STAGES = {"dpo", "ppo", "grpo"}


def stage_problems(cfg: Any, dp: int = 1) -> list[str]:
    """The chosen stage's own fields, and what it needs from data and model (`dp`: the data-parallel size)."""
    name, d = cfg.stage.name, cfg.data
    problems = []
    if name in PAIR_STAGES:
        if d.format != "preference":
            problems.append(f"stage {name} trains on pairs: data.format={d.format!r} must be preference (rows with "
                            "chosen and rejected, and optionally prompt)")
        if d.packing:
            problems.append(f"stage {name}: data.packing=true packs single sequences; pairs are not packed: "
                            "set data.packing=false")
        if cfg.model.dropout > 0:
            problems.append(f"stage {name} runs every forward without dropout (as TRL does: the chosen and rejected "
                            f"scores must come from the same function): model.dropout={cfg.model.dropout} must be 0")
    if name in RL_STAGES:
        from llmtrain.stages.ppo.checks import ppo_problems

        problems += ppo_problems(cfg, name, dp)
    if name == "reward" and cfg.reward.center_coef < 0:
        problems.append(f"reward.center_coef={cfg.reward.center_coef} must be >= 0")
    if name == "dpo":
        if not cfg.dpo.beta > 0:
            problems.append(f"dpo.beta={cfg.dpo.beta} must be > 0 (typical: 0.1; it scales the implicit reward)")
        if not 0 <= cfg.dpo.label_smoothing < 0.5:
            problems.append(f"dpo.label_smoothing={cfg.dpo.label_smoothing} must be in [0, 0.5)")
        if cfg.dpo.loss == "ipo" and cfg.dpo.label_smoothing > 0:
            problems.append("dpo.label_smoothing applies to dpo.loss=sigmoid only: set it to 0 with ipo")
    return problems


def data_parallel_size(backend: BackendConfig, world_size: int) -> int:
    """Ranks that see different data (tensor-parallel peers share theirs), from the run's ParallelDims;
    for degrees that do not fit the world (reported by the backend check) world // tp."""
    from llmtrain.parallel import ParallelDims

    degrees = ParallelDims.degrees(backend)
    if ParallelDims.problems(*degrees, world_size):
        return max(1, world_size // max(1, degrees[2]))
    return ParallelDims.build(*degrees, world_size).dp_size


def backend_config_problems(backend: BackendConfig, world_size: int) -> list[str]:
    """The chosen backend's own checks (pure Python, no backend library imported)."""
    from llmtrain.backends.checks import BACKEND_CONFIG_CHECKS

    check = BACKEND_CONFIG_CHECKS.get(backend.name)
    return check(backend, world_size) if check else []


def _batch_problems(t: TrainerConfig, data_parallel_size: int) -> list[str]:
    derived = t.micro_batch_size * t.grad_accum_steps * data_parallel_size
    if t.global_batch_size is not None and t.global_batch_size != derived:
        return [
            f"trainer.global_batch_size={t.global_batch_size} but trainer.micro_batch_size "
            f"{t.micro_batch_size} × trainer.grad_accum_steps {t.grad_accum_steps} × dp "
            f"{data_parallel_size} = {derived}; change one of them or drop trainer.global_batch_size"
        ]
    return []


def _source_problems(cfg: Any) -> list[str]:
    problems = []
    m, d = cfg.model, cfg.data
    if (m.name_or_path is None) == (m.from_config is None):
        problems.append("set exactly one of model.name_or_path (a directory or hub id) and "
                        "model.from_config (random init: model_type plus size fields)")
    if m.from_config is not None and "model_type" not in m.from_config:
        problems.append("model.from_config needs model_type (llama, qwen2, mistral, gpt2, ...)")
    if m.from_config is not None and m.tokenizer is None:
        problems.append("model.from_config has no weights directory to take a tokenizer from: "
                        "set model.tokenizer")
    if not d.train_files and d.dataset is None:
        problems.append("no training data: set data.train_files=[...] or data.dataset=NAME")
    if d.train_files and d.dataset is not None:
        problems.append("set data.train_files or data.dataset, not both")
    if d.eval_files and d.eval_fraction > 0:
        problems.append("set data.eval_files or data.eval_fraction, not both")
    if d.overlong == "chunk" and d.format != "text":
        problems.append(f"data.overlong=chunk splits plain text into rows; a {d.format} sample cut in two loses "
                        f"its prompt or response: use data.overlong=truncate or drop")
    if cfg.stage.name == "sft" and d.format not in SFT_FORMATS:
        problems.append(f"stage sft trains on responses only: data.format={d.format!r} must be one of "
                        f"{', '.join(SFT_FORMATS)} (use stage=pretrain for plain text)")
    if cfg.stage.name == "pretrain" and d.format != "text":
        problems.append(f"stage pretrain trains on every token: data.format={d.format!r} must be text "
                        "(use stage=sft for prompt/response data)")
    return problems


def validate(cfg: Any, world_size: int) -> None:
    problems = config_problems(cfg, world_size)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
