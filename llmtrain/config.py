"""The typed config schema (Hydra structured configs) of the run's own fields, and their checks.

The ground floor: this module imports nothing from llmtrain. Stages add their own top-level nodes and backends
their typed groups (`llmtrain.schema` assembles the whole); `llmtrain.validation` collects every component's
problems, each line naming the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


@dataclass
class SpikeConfig:
    """trainer.spike (llmtrain/spikes.py): a step whose loss (or grad norm) exceeds factor × the running median."""
    policy: str = "off"  # off | log (metrics only) | skip (no update, as skip_nonfinite) | rollback (reload the
    # last complete checkpoint and skip the data since it; listed in skipped_data.jsonl)
    metric: str = "loss"  # loss | grad_norm: the globally reduced value the Updater reports
    factor: float = 3.0  # a spike: value > factor × the median of the last `window` values (must be > 1)
    window: int = 50  # values the running median is taken over
    warmup_steps: int = 20  # updates observed before any step can count as a spike
    max_rollbacks: int = 3  # policy=rollback: the run stops with an error (exit code 3) at the next spike after these


@dataclass
class TrainerConfig:
    max_steps: int = 100  # optimizer steps to train (PPO/GRPO: iterations, each a rollout and its updates)
    seed: int = 1234  # seeds the data order, weights not loaded from a checkpoint, dropout and sampling
    micro_batch_size: int = 8  # rows per forward on each rank (the pair stages: pairs; PPO: sequences)
    grad_accum_steps: int = 1  # micro-batches per optimizer step on each rank (under pp: the pipeline's)
    global_batch_size: Optional[int] = None  # when set: must equal micro × accum × dp
    eval_every_n_steps: int = 0  # 0: evaluate only after the last step
    eval_batch_size: Optional[int] = None  # default: micro_batch_size
    log_every_n_steps: int = 10  # console lines and the straggler check's window; metrics.jsonl gets every step
    straggler_threshold: float = 0.2  # a rank is slow in a log window when its busy time exceeds the median rank's
    # by more than this fraction of it (metrics/straggler.py)
    straggler_windows: int = 3  # a rank slow in this many log windows in a row is named (log, straggler_rank)
    save_every_n_steps: int = 0  # 0: save only after the last step
    keep_last_k: int = 2  # complete checkpoints kept along this run's lineage; older ones are removed
    async_save: bool = False  # true: the save copies the state to host memory and writes it in the background
    # (complete, `latest` and pruned at the next save or the end; FSDP2 and DDP; docs/guide/checkpoints.md)
    skip_nonfinite: bool = False  # true: skip a step whose loss or grad norm is not finite (counted in
    # skipped_steps); false: stop every rank with an error (exit code 3)
    collective_timeout_s: int = 600  # a collective stuck longer than this ends the job, naming the rank and step
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # loss spikes: logged, skipped or rolled back


@dataclass
class MuonConfig:
    """optim.name=muon (llmtrain/optim): torch.optim.Muon on the hidden matrices, AdamW (OptimConfig's) on the rest."""
    lr: Optional[float] = None  # null: optim.lr (adjust_lr_fn=match_rms_adamw makes the AdamW lr carry over)
    weight_decay: Optional[float] = None  # null: optim.weight_decay
    momentum: float = 0.95  # Muon's momentum
    nesterov: bool = True  # Nesterov momentum
    ns_steps: int = 5  # Newton-Schulz iterations that orthogonalise each update
    ns_coefficients: List[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])  # (a, b, c) of
    # the Newton-Schulz polynomial (torch.optim.Muon's)
    eps: float = 1e-7  # added to the norm Newton-Schulz divides by
    adjust_lr_fn: str = "match_rms_adamw"  # | original (Keller Jordan's; torch's default)
    experts: str = "per_matrix"  # 3-D MoE weights: Muon on each expert matrix | adamw


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon
    lr: float = 3e-4  # peak learning rate, reached after warmup_steps
    weight_decay: float = 0.1  # AdamW's decoupled weight decay; never on biases and norms
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam's (β1, β2)
    eps: float = 1e-8  # Adam's ε
    warmup_steps: int = 0  # linear warm-up from 0 to lr over these optimizer steps
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1  # the lr the schedule ends at, as a fraction of lr
    max_grad_norm: float = 1.0  # 0 = no clipping (the norm is still reported)
    muon: MuonConfig = field(default_factory=MuonConfig)  # read under name=muon only


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = None  # local directory or hub id
    from_config: Optional[Dict[str, Any]] = None  # {model_type: llama, hidden_size: ..., ...}
    config_path: Optional[str] = None  # a shipped config.json: validates a hub id offline
    tokenizer: Optional[str] = None  # default: the model directory
    attn_implementation: str = "auto"  # auto: flash_attention_2 on GPU when installed, else flex_segments on GPU,
    # sdpa_segments on CPU
    activation_checkpointing: bool = False  # recompute each block's activations in backward (less memory)
    dropout: float = 0.0  # dropout set in the model's config; 0 for the pairwise and RL stages
    trust_remote_code: bool = False  # let transformers run code shipped with a checkpoint (trusted ones only)
    fused_loss: str = "auto"  # auto | chunked | liger | off: the LM head and the loss computed together over chunks
    # of tokens (no (tokens, V) logits); liger: Liger Kernel's fused linear cross-entropy for the causal-LM sum (CUDA,
    # liger_kernel installed, no tp: models/liger.py); off: full logits; auto: full logits where the vocabulary is
    # small (V ≤ 5.7·h: models/fused_head.head_is_fused), else liger where it can run, else chunked
    loss_chunk_tokens: int = 0  # tokens per chunk of the fused head; 0: chosen from the vocabulary and hidden size


@dataclass
class DataConfig:
    train_files: List[str] = field(default_factory=list)  # local .jsonl / .json / .parquet files
    eval_files: List[str] = field(default_factory=list)  # held-out files (or eval_fraction)
    eval_fraction: float = 0.0  # the share of the training rows held out for eval (a seeded split)
    dataset: Optional[str] = None  # a `datasets` name or a save_to_disk directory (instead of train_files)
    split: str = "train"  # the dataset's training split
    eval_split: Optional[str] = None  # the dataset's held-out split (or eval_fraction)
    format: str = "text"  # text | prompt_response | alpaca | messages | preference | unpaired (data/formats.py)
    max_seq_len: int = 512  # tokens per row; longer samples follow data.overlong
    packing: bool = False  # several samples per row (best-fit decreasing), attention within each sample
    overlong: str = "truncate"  # truncate | drop | chunk (text only: a long text becomes several rows)
    num_workers: int = 0  # DataLoader worker processes (the samples of a step do not depend on it)
    group_by_length: bool = False  # batches of similar lengths: less padding, less random order
    ignore_columns: List[str] = field(default_factory=list)  # columns carrying a preference signal (chosen, rejected,
    # label, margin, kind) that data.format may drop unread; any other such column is an error (data/formats.py)


@dataclass
class WandbConfig:
    enabled: bool = False  # log to Weights & Biases (logger=wandb sets it)
    project: str = "llmtrain"  # the W&B project
    name: Optional[str] = None  # the W&B run name; null: W&B's
    dir: Optional[str] = None  # default: the run dir
    mode: Optional[str] = None  # null respects WANDB_MODE; online | offline
    entity: Optional[str] = None  # the W&B entity (user or team); null: your default
    tags: List[str] = field(default_factory=list)  # W&B run tags


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class BackendNode:
    """The `backend` node: each backend's typed group (its descriptor's config_class, llmtrain/backends/) extends it
    with its own fields only, so a key of another backend is refused by name (backends.misplaced_key_message)."""
    name: str = "???"  # one of llmtrain.backends.BACKENDS (conf/config.yaml picks the default)


@dataclass
class StageConfig:
    name: str = "???"  # one of the stages in llmtrain.stages.registry (conf/config.yaml picks the default)


@dataclass
class PeftConfig:
    """peft=lora: low-rank adapters (the peft library) on the trainable roles; the base stays frozen."""
    name: str = "none"  # none | lora
    r: int = 8  # the adapters' rank
    alpha: float = 16.0  # LoRA's alpha: the adapters' output is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input; 0 for DPO's and PPO's adapter-off reference
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
    # a100-40gb | a100-80gb | h100-80gb | h200 | rtx-4090 | cpu | any name with the two below;
    # null: this machine's device
    gpu: Optional[str] = None
    peak_tflops: Optional[float] = None  # dense 16-bit peak per device (overrides the table's)
    memory_gb: Optional[float] = None  # device memory in GiB (overrides the table's)
    link_gb_per_s: Optional[float] = None  # per-rank collective bandwidth, GB/s one way (overrides the table's)
    mfu: float = 0.4  # compute efficiency the step time assumes (model FLOPs / peak while computing)
    compare_backends: bool = False  # one table, a row per backend (ddp, zero1..3, zero3_offload, fsdp2, fsdp2_tp)
    # a run whose plan does not fit the memory (a GPU's; on a CPU the host's RAM over its local ranks) stops before
    # anything loads, naming the fixes; false: run anyway (dry_run and `python -m llmtrain.plan` never stop)
    enforce_fit: bool = True


@dataclass
class RunConfig:
    recipe: str = ""  # the recipe composed (recipe=NAME: recipes/NAME.yaml, or a path to a yaml)
    output_dir: Optional[str] = None  # the run directory; default: runs/<recipe>
    resume: Optional[str] = None  # auto | PATH (a run dir or one step folder) | null
    dry_run: bool = False  # true: resolve, validate, print the summary and the plan for this world, exit
    precision: str = "auto"  # auto: fp32 on CPU, bf16 on a GPU that supports it; fp16 scales the loss dynamically
    device: str = "auto"  # auto: cuda when a GPU is visible, else cpu
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    backend: BackendNode = field(default_factory=BackendNode)
    stage: StageConfig = field(default_factory=StageConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


CHOICES = {  # the schema's own fields; the registries' names (stage, backend, data.format, peft ...) are theirs
    "precision": ("auto", "fp32", "bf16", "fp16"),
    "device": ("auto", "cpu", "cuda"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "data.overlong": ("truncate", "drop", "chunk"),
    "model.fused_loss": ("auto", "chunked", "liger", "off"),
    "trainer.spike.policy": ("off", "log", "skip", "rollback"),
    "trainer.spike.metric": ("loss", "grad_norm"),
}
OUTPUT_LAYERS = ("lm_head",)  # never a LoRA target: peft's all-linear leaves it out too


def get_field(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def choice_problems(cfg: Any, choices: dict[str, tuple]) -> list[str]:
    problems = []
    for name, allowed in choices.items():
        value = get_field(cfg, name)
        if value not in allowed:
            problems.append(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return problems


def schema_problems(cfg: Any) -> list[str]:
    """The problems of the schema's own fields (trainer, optim, model, data), without model, data or registries."""
    problems = choice_problems(cfg, CHOICES)
    t, o, d, m = cfg.trainer, cfg.optim, cfg.data, cfg.model
    positive = {"trainer.max_steps": t.max_steps, "trainer.micro_batch_size": t.micro_batch_size,
                "trainer.grad_accum_steps": t.grad_accum_steps, "data.max_seq_len": d.max_seq_len,
                "trainer.keep_last_k": t.keep_last_k, "trainer.collective_timeout_s": t.collective_timeout_s}
    problems += [f"{k}={v} must be >= 1" for k, v in positive.items() if v < 1]
    non_negative = {"trainer.eval_every_n_steps": t.eval_every_n_steps, "trainer.save_every_n_steps":
                    t.save_every_n_steps, "trainer.log_every_n_steps": t.log_every_n_steps,
                    "optim.warmup_steps": o.warmup_steps, "optim.max_grad_norm": o.max_grad_norm,
                    "optim.weight_decay": o.weight_decay, "data.num_workers": d.num_workers,
                    "model.loss_chunk_tokens": m.loss_chunk_tokens}
    problems += [f"{k}={v} must be >= 0" for k, v in non_negative.items() if v < 0]
    if not o.lr > 0:
        problems.append(f"optim.lr={o.lr} must be > 0")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.append(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    if not 0 <= o.min_lr_ratio <= 1:
        problems.append(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if m.attn_implementation.startswith("flash_attention") and cfg.precision == "fp32":
        problems.append(f"model.attn_implementation={m.attn_implementation} runs in bf16/fp16 only, "
                        "but precision=fp32: "
                        "use precision=bf16 (or auto on a GPU), or model.attn_implementation=auto")
    if m.attn_implementation in ("flex_segments", "flex_attention") and m.dropout > 0:  # models/flex.py
        problems.append(f"model.attn_implementation={m.attn_implementation} has no attention dropout, but "
                        f"model.dropout={m.dropout}: use model.dropout=0, or sdpa_segments")
    if not 0 <= m.dropout < 1:
        problems.append(f"model.dropout={m.dropout} must be in [0, 1)")
    if not 0 <= d.eval_fraction < 1:
        problems.append(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
    return problems + _source_problems(cfg)


def batch_problems(t: TrainerConfig, data_parallel_size: int) -> list[str]:
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
    return problems
