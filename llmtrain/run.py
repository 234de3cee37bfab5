"""One run, in order: validate (every rank, nothing loaded) -> plan/dry run -> process group -> tokenizer
-> data -> model -> engine -> resume -> fit -> HF export. The config stops at the builders of the registries (a
stage's `build`, a backend's options): the classes they build take plain values."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from llmtrain import checkpoint as ckpt
from llmtrain.backends import build_backend
from llmtrain.backends.base import OptimizerSpec, autocast_dtype
from llmtrain.config import ConfigError
from llmtrain.data.pipeline import eval_batches, train_batches
from llmtrain.data.sequence_shard import RowShare, sequence_preparer
from llmtrain.distributed import (
    DistContext,
    env_world_size,
    init_distributed,
    quiesce,
    resolve_device,
    resolve_precision,
    shutdown,
)
from llmtrain.doctor import summary_line
from llmtrain.metrics.live import live_cost
from llmtrain.metrics.sinks import ConsoleSink, JsonlSink, WandbSink
from llmtrain.metrics.straggler import StragglerWatch
from llmtrain.models.attention import SEGMENT_ATTENTION
from llmtrain.models.flex import FLEX_IMPLEMENTATIONS
from llmtrain.models.fused_head import head_is_fused
from llmtrain.models.liger import head_kernel, liger_installed
from llmtrain.models.load import (
    attention_for_family,
    load_tokenizer,
    model_config,
    packed_window_problems,
    resolve_attn_implementation,
)
from llmtrain.models.lora import LoraSettings
from llmtrain.models.torch_context_parallel import register_cp_attention
from llmtrain.models.ulysses import ulysses_attention
from llmtrain.optim.spec import muon_spec
from llmtrain.parallel import degree_of
from llmtrain.parallel.cp import cp_implementation
from llmtrain.plan.core import check_backend_against_model
from llmtrain.plan.figures import RunPlan
from llmtrain.plan.fit import run_fit_problems
from llmtrain.plan.report import plan_run
from llmtrain.roles import ModelOptions, build_engines
from llmtrain.run_metadata import run_metadata
from llmtrain.spikes import SpikeRule, window_examples
from llmtrain.stages.base import trainable_roles
from llmtrain.stages.registry import build_stage, decide_attention, load_stage_data, stage_roles, stage_spec
from llmtrain.trainer import Trainer, TrainerSettings
from llmtrain.validation import validate

log = logging.getLogger("llmtrain")


def check_run_dir(run_dir: Path, resume: str | None) -> None:
    if resume is None and ckpt.has_checkpoints(run_dir):
        raise ConfigError(f"output_dir={run_dir} already holds checkpoints: pass resume=auto to continue "
                          "that run, or another output_dir (nothing was overwritten)")


def optimizer_spec(cfg: DictConfig, updates_per_step: int = 1) -> OptimizerSpec:
    """`updates_per_step`: optimizer steps in one trainer step (PPO: epochs × mini-batches); the schedule counts
    them."""
    o = cfg.optim
    return OptimizerSpec(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                         warmup_steps=o.warmup_steps, schedule=o.schedule, min_lr_ratio=o.min_lr_ratio,
                         max_grad_norm=o.max_grad_norm, max_steps=cfg.trainer.max_steps * updates_per_step,
                         muon=muon_spec(o))


def backend_options(cfg: DictConfig, run_dir: Path) -> dict:
    """cfg.backend as a plain dict, plus `run`: the values a backend may need from outside its group
    (DeepSpeed writes the batch triple into its own config, and that config into the run dir)."""
    options = OmegaConf.to_container(cfg.backend, resolve=True)
    options["run"] = {"micro_batch_size": cfg.trainer.micro_batch_size,
                      "grad_accum_steps": cfg.trainer.grad_accum_steps, "output_dir": str(run_dir),
                      "max_seq_len": cfg.data.max_seq_len}
    return options


def run(cfg: DictConfig) -> None:
    world = env_world_size()
    validate(cfg, world)
    run_dir = Path(cfg.output_dir)
    check_run_dir(run_dir, cfg.resume)
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    plan = plan_run(cfg, world, device, precision)  # also validates model.from_config fields
    check_backend_against_model(cfg, world)
    if cfg.dry_run:
        print(plan.text, flush=True)
        return
    too_big = run_fit_problems(cfg, plan)  # every rank, before the process group and any weights (plan.enforce_fit)
    if too_big:
        raise ConfigError("\n".join(too_big))
    resume_dir = ckpt.find_resume_dir(cfg.resume, run_dir)
    ctx = init_distributed(cfg.device, cfg.trainer.collective_timeout_s)
    try:
        _train(cfg, ctx, run_dir, precision, plan, resume_dir)
    finally:
        shutdown()


def _train(cfg: DictConfig, ctx: DistContext, run_dir: Path, precision: str, plan: RunPlan,
           resume_dir: Path | None) -> None:
    m = cfg.model
    if ctx.is_main:
        log.info("plan:\n%s", plan.text)
    tokenizer = load_tokenizer(m.tokenizer or m.name_or_path, m.trust_remote_code)
    configs = [model_config(r.source.name_or_path, r.source.from_config, r.source.config_path,
                            r.source.trust_remote_code, vocab_size=len(tokenizer)) for r in stage_roles(cfg).values()]
    attn = decide_attention(cfg, resolve_attn_implementation(m.attn_implementation, ctx.device, precision, m.dropout),
                            lambda a: attention_for_family(a, m.attn_implementation, configs))
    stage = build_stage(cfg, tokenizer, attn)  # may give the tokenizer what its roles need (a pad token != eos)
    try:
        _train_stage(cfg, ctx, run_dir, precision, plan, resume_dir, tokenizer, stage, attn, configs)
    finally:
        stage.close()  # what the stage started (an inference server), on success and on every failure


def _train_stage(cfg: DictConfig, ctx: DistContext, run_dir: Path, precision: str, plan: RunPlan,
                 resume_dir: Path | None, tokenizer, stage, attn: str, configs: list) -> None:
    m, d, t = cfg.model, cfg.data, cfg.trainer
    if packs_rows(cfg, attn):
        problems = packed_window_problems(attn, configs, d.max_seq_len)
        if problems:
            raise ConfigError("; ".join(problems))
    data = load_stage_data(cfg, tokenizer)
    if ctx.is_main:
        log.info("train data: %s", data.train_stats.summary())
        if data.eval_stats is not None:
            log.info("eval data: %s", data.eval_stats.summary())
    backend = build_backend(cfg.backend.name, ctx, precision, backend_options(cfg, run_dir))
    rows, model_attn = sequence_parallel_attention(backend, attn, cp_implementation(cfg.backend))
    updates_per_step = stage.optimizer_steps_per_step()
    engines = build_engines(stage.roles, backend, tokenizer,
                            ModelOptions(model_attn, m.dropout, m.activation_checkpointing,
                                         *fused_head(cfg, ctx, configs[0], len(tokenizer))),
                            t.seed, optimizer_spec(cfg, updates_per_step), lora=LoraSettings.from_config(cfg.peft))
    prepare_batch = batch_preparer(ctx.device, precision, attn, rows)
    engines = stage.prepare(engines, data, prepare_batch)
    config_yaml = _config_yaml(cfg, ctx, precision)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)
    first = next(iter(engines.values()))
    dp_rank, dp_size = first.dp_rank, first.dp_size
    # examples per fetch and fetches per step on each rank (PPO: one fetch of this rank's share of the prompts)
    per_fetch, fetches = stage.fetch_layout(t.micro_batch_size, t.grad_accum_steps, dp_size)
    settings = TrainerSettings(max_steps=t.max_steps, fetches_per_step=fetches,
                               global_batch_size=per_fetch * fetches * dp_size,
                               eval_every_n_steps=t.eval_every_n_steps, save_every_n_steps=t.save_every_n_steps,
                               skip_nonfinite=t.skip_nonfinite, collective_timeout_s=t.collective_timeout_s,
                               spike=SpikeRule.from_config(t.spike))
    trainer = Trainer(
        settings, ctx=ctx, stage=stage, engines=engines,
        train_batches=lambda start: train_batches(
            data.train, micro_batch_size=per_fetch, grad_accum_steps=fetches,
            dp_rank=dp_rank, dp_size=dp_size, seed=t.seed, collate_fn=stage.collate,
            num_workers=d.num_workers, start_step=start, group_by_length=d.group_by_length),
        eval_batches=None if data.eval is None else eval_batches(
            data.eval, batch_size=t.eval_batch_size or t.micro_batch_size, dp_rank=dp_rank,
            dp_size=dp_size, collate_fn=stage.collate),
        checkpointer=ckpt.Checkpointer(run_dir, t.keep_last_k, ctx, async_save=t.async_save),
        config_yaml=config_yaml, sinks=[],
        prepare_batch=prepare_batch,
        live=live_cost(ctx, plan.figures, engines, trainable_roles(stage.roles)),
        straggler=StragglerWatch(every=t.log_every_n_steps, threshold=t.straggler_threshold,
                                 windows=t.straggler_windows, ctx=ctx),
        window_examples=window_examples(data.train, settings.global_batch_size, t.seed, d.group_by_length))
    if resume_dir is not None:
        trainer.resume_from(resume_dir)
    trainer.sinks = _sinks(cfg, run_dir, trainer.step, resume_dir is not None, config_yaml) if ctx.is_main else []
    try:
        finished = trainer.fit()  # False: stopped by a signal, saved; the run is not over
        if ctx.is_main:
            log.info("%s", summary_line(run_dir))  # where the step time went (llmtrain/doctor.py)
        if finished:
            export(stage, engines, tokenizer, run_dir, ctx)
        quiesce()  # before the engines (DDP's Reducer, DeepSpeed's groups) are released on return: see quiesce
    finally:
        for sink in trainer.sinks:
            sink.close()


def export(stage, engines: dict, tokenizer, run_dir: Path, ctx: DistContext) -> None:
    """Every trainable role as a Hugging Face folder: the first in `hf/`, others in `<role>_hf/`, each with
    the tokenizer and whatever the stage adds to its config (a reward model's reward mean/std)."""
    trainable = trainable_roles(stage.roles)
    for i, role in enumerate(trainable):
        directory = run_dir / ("hf" if i == 0 else f"{role}_hf")
        engines[role].export_hf(directory)
        if ctx.is_main:
            tokenizer.save_pretrained(directory)
            extra = stage.export_config(role)
            if extra:
                config_file = directory / "config.json"
                config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **extra}, indent=2) + "\n")
            log.info("%s: Hugging Face export in %s", role, directory)
    if ctx.is_main:
        log.info("done: %d roles exported", len(trainable))


def packs_rows(cfg: DictConfig, attn: str) -> bool:
    """Several samples share a row: data.packing, or a pair stage's padding-free pairs under a flex attention (the
    other padding-free attentions keep sliding windows: models/load.WINDOW_KEEPING)."""
    return cfg.data.packing or (stage_spec(cfg.stage.name).pairs and attn in FLEX_IMPLEMENTATIONS)


def fused_head(cfg: DictConfig, ctx: DistContext, config, tokenizer_size: int) -> tuple[int | None, str]:
    """model.fused_loss -> (the fused head's chunk tokens (0: chosen from V and h) or None for full logits, the
    kernel of its summed loss: "chunked" or "liger", models/liger.py). `config`: the trained model's architecture,
    whose V (at least the tokenizer's) and h decide `auto` (models/fused_head.head_is_fused)."""
    m = cfg.model
    vocab, hidden = max(config.vocab_size, tokenizer_size), config.hidden_size
    if not head_is_fused(m.fused_loss, vocab, hidden):
        why = "model.fused_loss=off" if m.fused_loss == "off" else \
            f"model.fused_loss=auto: V {vocab} ≤ 5.7 × h {hidden}, the logits weigh less than two layers' activations"
        if ctx.is_main:
            log.info("LM head and loss: full (tokens, V) logits (%s)", why)
        return None, "chunked"
    kernel, why = head_kernel(m.fused_loss, ctx.device.type, degree_of(cfg.backend, "tp"), cfg.stage.name,
                              stage_spec(cfg.stage.name).lm_loss_sum, liger_installed())
    if ctx.is_main:
        chunk = m.loss_chunk_tokens or "V- and h-sized"
        log.info("LM head and loss: fused, over chunks of %s tokens; summed loss: %s (%s)", chunk, kernel, why)
    return m.loss_chunk_tokens, kernel


def sequence_parallel_attention(backend, attn: str, cp_implementation: str = "ring") -> tuple[RowShare, str]:
    """(the cp × sp ranks sharing each row, the models' attention): with backend.cp > 1 ring
    attention (models/ring_attention.py, or torch's with cp_implementation "torch": models/torch_context_parallel.py),
    with backend.sp > 1 the run's attention (or the ring) behind the Ulysses exchange (models/ulysses.py), each
    registered under a name of this run's own; else `attn` itself."""
    dims = getattr(backend, "dims", None)
    if dims is None or dims.row_size == 1:
        return RowShare(), attn
    if attn != SEGMENT_ATTENTION:  # validation refuses what it can read; a hub family falling back to eager here
        raise ConfigError(f"backend.sp={dims.sp}, backend.cp={dims.cp}: the model runs {attn} attention, sequence and "
                          f"context parallelism need {SEGMENT_ATTENTION} (model.attn_implementation="
                          f"{SEGMENT_ATTENTION}); set backend.sp=1 and backend.cp=1")
    if dims.cp > 1:
        attn = register_cp_attention(cp_implementation, dims.cp, dims.mesh("cp"))
    if dims.sp > 1:
        attn = ulysses_attention(attn, dims.sp, dims.mesh("sp").get_group())
    return dims.row_share(), attn


def batch_preparer(device: torch.device, precision: str, attn_implementation: str, rows: RowShare | None = None):
    """Move a batch to the device with the attention inputs its attention reads (a dense packed mask, when
    one is needed, in the compute dtype: sdpa wants them equal). With rows shared by several ranks (cp × sp): this
    rank's sequence shard of it, cut on the host (data/sequence_shard.py; a pair batch sums its sequences' parts over
    `rows.group`)."""
    mask_dtype = autocast_dtype(precision) or torch.float32
    if rows is not None and rows.size > 1:
        shard = sequence_preparer(attn_implementation, rows)
        return lambda batch: shard(batch).to(device, non_blocking=device.type == "cuda")

    def prepare(batch):
        return batch.to(device, non_blocking=device.type == "cuda").for_attention(attn_implementation, mask_dtype)

    return prepare


def _config_yaml(cfg: DictConfig, ctx: DistContext, precision: str) -> str:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["run_metadata"] = run_metadata(ctx.world_size, cfg.backend.name, ctx.device, precision)
    return OmegaConf.to_yaml(OmegaConf.create(resolved))


def _sinks(cfg: DictConfig, run_dir: Path, start_step: int, resumed: bool, config_yaml: str) -> list:
    """metrics.jsonl and the console; W&B when enabled, with the resolved config and run metadata (the
    config.yaml text, redacted by the sink) and its run id in the run dir (`wandb.json`)."""
    metrics = run_dir / "metrics.jsonl"
    if not resumed and metrics.exists():  # a run that died before its first checkpoint: keep its log
        metrics.rename(run_dir / f"metrics.{int(time.time())}.jsonl")
    sinks = [JsonlSink(metrics, resume_step=start_step if resumed else None),
             ConsoleSink(cfg.trainer.max_steps, start_step, cfg.trainer.log_every_n_steps)]
    w = cfg.logger.wandb
    if w.enabled:
        sinks.append(WandbSink(project=w.project, name=w.name or run_dir.name, directory=Path(w.dir or run_dir),
                               mode=w.mode, entity=w.entity, tags=list(w.tags),
                               config=yaml.safe_load(config_yaml), group=stage_spec(cfg.stage.name).metric_group,
                               state_file=run_dir / "wandb.json", resumed=resumed))
    return sinks
