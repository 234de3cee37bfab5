"""`python -m llmtrain.plan recipe=NAME [plan.world_size=8 plan.gpu=h100-80gb plan.compare_backends=true] ...`:
what a run would cost per rank on a cluster, from the resolved config and the model on the meta device (no
weights, seconds). `dry_run=true` of `python -m llmtrain` prints the same for the current world (for plan.world_size
when it is set).

Per role (`stages.registry.stage_roles`) and backend: weights, gradients, optimizer state, gathered copies
(`metrics/cost.py`, as each backend really holds them), activations and logits at the micro-batch, the total
against the device memory, the largest micro-batch that fits, communication per step and the step time at
`plan.mfu`. FLOPs convention: M counts every parameter, the input embedding (a lookup, no matmul: an
overestimate of 6·V·h per token) and the LM head included; 12·L·h·s for the attention products, no causal
halving. docs/formulas.md, "The planner", has every formula.

This module lays the figures out (the table, the header and notes, the run's summary); core.py computes them.
"""

from __future__ import annotations

import io
import sys

from omegaconf import DictConfig

from llmtrain.backends import spec_of
from llmtrain.config import ConfigError
from llmtrain.metrics.cost import (
    GIB,
    Layout,
    activation_bytes_per_layer,
    eager_score_bytes,
    gated_activation_bytes_per_layer,
    logits_bytes,
)
from llmtrain.metrics.devices import Gpu, resolve_gpu
from llmtrain.metrics.flops import human, training_flops_per_token
from llmtrain.metrics.memory import frozen_elem_bytes, planned_state_bytes
from llmtrain.models.facts import ModelFacts, model_facts
from llmtrain.parallel import row_degrees
from llmtrain.parallel.dimension import dimension_lines
from llmtrain.plan.core import (
    SEQ_SEARCH_LIMIT,
    USABLE,
    Row,
    check_backend_against_model,
    compared_layouts,
    head_bytes,
    layout_of,
    longest_sequence,
    plan_row,
    plan_rows,
    row_name,
)
from llmtrain.plan.figures import RunPlan, pipeline_figures, pipelined_head, plan_figures, stage_activations
from llmtrain.plan.pp import pipeline_layout, pipeline_lines, pipeline_p2p
from llmtrain.plan.rl import engine_lines, engine_memory, engine_model, engine_setup
from llmtrain.plan.setting import Setting, plan_precision, setting
from llmtrain.stages.registry import stage_spec
from llmtrain.validation import data_parallel_size, validate


def _size(value: float) -> str:
    """GiB with three significant digits (a tiny model's MiB show as 0.00x)."""
    return f"{value / GIB:.3g}"


COLUMNS = ("backend", "degrees", "weights", "grads", "optim", "gathered", "activ.", "logits", "total", "fits",
           "max micro", "off-device", "comm GB", "step s", "MFU", "formula")


def degrees(layout) -> str:
    """The row's parallel degrees, dp always and the others where > 1: `dp2·cp4·sp2`, `dp8·ep8`, `dp4·tp2`."""
    named = {"dp": layout.dp, "tp": layout.tp, "cp": layout.cp, "sp": layout.sp, "ep": layout.ep}
    return "·".join(f"{name}{value}" for name, value in named.items() if name == "dp" or value > 1)


def row_cells(row: Row, memory_gib: float) -> list[str]:
    s = row.states.values()
    off = sum(x.host + x.nvme for x in s)
    t = row.times
    return [row.layout.name, degrees(row.layout), _size(sum(x.weights for x in s)), _size(sum(x.grads for x in s)),
            _size(sum(x.master + x.optim for x in s)), _size(sum(x.gathered for x in s)), _size(row.activations),
            _size(row.logits), _size(row.device_bytes), f"{'yes' if row.fits else 'NO'} ({memory_gib:.0f})",
            str(row.max_micro), _size(off) if off else "-", f"{sum(c.wire for c in row.comm) / 1e9:.3g}",
            f"{t['step_s']:.3g}" if t else "n/a", f"{t['mfu']:.0%}" if t else "n/a", _size(row.textbook)]


def table(rows: list[Row], gpu: Gpu) -> str:
    """One line per backend: rich's table when rich is installed, else aligned plain text."""
    cells = [row_cells(r, gpu.memory_gib) for r in rows]
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency; plain text keeps the planner usable without it
        widths = [max(len(c[i]) for c in [list(COLUMNS), *cells]) for i in range(len(COLUMNS))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [list(COLUMNS), *cells])
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in COLUMNS:
        grid.add_column(name, justify="left" if name == "backend" else "right")
    for line in cells:
        grid.add_row(*line)
    console = Console(file=io.StringIO(), width=200, color_system=None, force_terminal=False)
    console.print(grid)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines() if line.strip())


def head_line(st: Setting) -> str:
    rows = st.micro * st.rows_per_sample
    full = f"logits b·s·V·4 = {_size(logits_bytes(rows, st.seq, st.logits_vocab))} GiB"
    if not st.fused_head:
        return full
    held = " + (b·s·h + V·h)·4 held gradients" if st.head_loss_sum else ""
    split = ", ⌈V/tp⌉ rows per rank under backend.tp (the logits column)" if st.facts.head else ""
    return (f"LM head and loss fused over chunks of {st.head_chunk} tokens: 3·c·V·4{held} = "
            f"{_size(head_bytes(st, rows, st.seq)[1])} GiB{split} (model.fused_loss=off: {full})")


def header(st: Setting) -> list[str]:
    f, g = st.facts, st.gpu
    h, L, s, V = f.hidden, f.layers, st.seq, f.vocab
    estimate = 12 * L * h * h + 13 * L * h + V * h * (1 if f.head == 0 else 2)
    elem = 2 if st.precision in ("bf16", "fp16") else 4
    per_layer = activation_bytes_per_layer(st.micro * st.rows_per_sample, s, h, f.heads, elem=elem, scores=st.scores)
    peak = f"{g.peak_tflops:g} TFLOP/s dense bf16" if g.peak_tflops else "no peak (tokens/s, not MFU)"
    lines = [
        f"plan: {st.world} × {g.name} ({g.memory_gib:.1f} GiB, {peak}, link {g.link_gb_per_s:g} GB/s), "
        f"precision {st.precision}, micro-batch {st.micro}{' pairs' if st.rows_per_sample == 2 else ''} × "
        f"accumulation {st.accum}, s={s}, activation checkpointing {'on' if st.checkpointing else 'off'}",
        f"parameters {f.params:,} (exact, meta device); cross-check 12·L·h² + 13·L·h + V·h{'' if f.head == 0 else '·2'}"
        f" = {estimate:,} ({(estimate - f.params) / f.params:+.1%}: SwiGLU / GQA / RMSNorm blocks differ from GPT's)",
        f"FLOPs per token 6·M + 12·L·h·s = {human(training_flops_per_token(f.params, L, h, s), 'FLOP')} "
        "(M: every parameter, input embedding and LM head included; no causal halving)"
        + (f"; + {human(2 * L * f.block + 4 * L * h * s, 'FLOP')} recompute (hardware FLOPs)"
           if st.checkpointing else ""),
        f"activations per layer {_size(per_layer)} GiB (34·b·s·h{' + 5·b·a·s²' if st.scores else ''}, "
        + ("the run's attention is eager: it stores the scores" if st.scores
           else "5·b·a·s² dropped: sdpa/flash/flex keep no (b,a,s,s) scores")
        + "); " + head_line(st),
    ]
    # the table's activations use the gated-block count (metrics/cost.py, measured per saved tensor)
    if f.intermediate:
        gated = gated_activation_bytes_per_layer(st.micro * st.rows_per_sample, s, h, f.heads,
                                                 intermediate=f.mlp_width,
                                                 kv_heads=f.kv_heads, elem=elem, scores=st.scores,
                                                 softcapping=f.softcapping)
        count = (f"s·b·(10h + 4i + 2) elements + b·a·s²·{eager_score_bytes(elem, f.softcapping)} bytes of eager "
                 f"scores{' (softcapped)' if f.softcapping else ''}" if st.scores
                 else "s·b·(8h + 2kv + 4i + a + 2) elements (tp t: s·b·(6h + 2 + (2h + 2kv + 4i + a)/t))")
        korthikanti = "34·b·s·h" + (" + 5·b·a·s²" if st.scores else "")
        lines.append(f"this model's gated blocks (RMSNorm, GQA, SwiGLU) keep {count}: "
                     f"{_size(gated)} GiB per layer ({gated / per_layer:.2f}× {korthikanti}), used in the table")
    if st.lora:
        lines.append(f"LoRA: {st.lora:,} trainable adapter parameters; the {f.params:,} of the base frozen "
                     "(weights only)")
    return lines


def roles_summary(st: Setting, row: Row) -> str:
    """The stage's roles; a frozen role holds its weights only (sharded under ZeRO-3/FSDP2)."""
    def described(role: str, state) -> str:
        if st.roles[role]:
            return f"{role} (trainable)"
        if role in st.views:
            return f"{role} (the policy with adapters disabled: no weights of its own)"
        return f"{role} (frozen: weights only ≈ {human(state.device, 'B', 1024)} per rank)"

    return "roles: " + ", ".join(described(role, state) for role, state in row.states.items())


def describe(cfg: DictConfig, world: int, gpu: Gpu, precision: str, facts: ModelFacts | None = None) -> list[str]:
    """The planner's lines: header, one table (the run's backend, or every preset with plan.compare_backends)."""
    facts = facts or model_facts(cfg)
    st = setting(cfg, world, gpu, precision, facts)
    notes: list[str] = []
    if cfg.plan.compare_backends:  # at the run's backend.sp, where a preset shards sequences
        layouts, notes = compared_layouts(cfg, world, facts, row_degrees(cfg.backend))
    else:
        layouts = [layout_of(row_name(cfg.backend), cfg.backend, world, facts.hidden)]
    rows = plan_rows(st, layouts)
    lines = [*header(st), "per rank, GiB (comm: GB sent per rank per step, ring; step at plan.mfu="
             f"{st.mfu:g} of peak, data-parallel traffic overlapped, TP's not; formula: the ZeRO paper's model states; "
             "weights..logits: bytes held, total: on the device, off-device: offloaded to host/NVMe)",
             table(rows, gpu), *notes]
    micro = st.micro * st.rows_per_sample  # rows (a pair is 2)
    run_layout = layout_of(row_name(cfg.backend), cfg.backend, world, facts.hidden)
    stage_bytes = stage_activations(st, run_layout)
    pipeline = pipeline_layout(cfg.backend, st.facts, accum=st.accum, seq=st.seq)
    lines += pipeline_lines(cfg.backend, st.facts, micro=micro, accum=st.accum, seq=st.seq, precision=st.precision,
                            dp=data_parallel_size(cfg.backend, world), tp=run_layout.tp, head=pipelined_head(st),
                            rank_activations=lambda rank: stage_bytes.rank(pipeline, rank, micro, st.seq),
                            lora=st.lora)
    if st.rl is not None:
        lines.append(f"{cfg.stage.name}: a step is one iteration: generate {st.rl.samples} sequences, the experience "
                     f"forwards, then {st.rl.updates} optimizer steps of each trainable role (comm and step s "
                     f"count all of it; the rollout's own gathers, a few KB, are left out)")
        lines += engine_section(cfg, st, rows)
    lines += dimension_lines(st, rows)
    if len(st.roles) > 1 or not cfg.plan.compare_backends:
        lines += [f"{r.layout.name}: {roles_summary(st, r)}" for r in rows]
    for r in rows:
        lines.append(f"{r.layout.name}: {'fits' if r.fits else 'does NOT fit'} at micro-batch {st.micro} "
                     f"({_size(r.device_bytes)} of {gpu.memory_gib:.1f} GiB, {USABLE:.0%} usable); "
                     f"largest micro-batch that fits {r.max_micro}")
    return lines + longest_sequence_lines(st, [r.layout for r in rows], row_degrees(cfg.backend))


def engine_section(cfg: DictConfig, st: Setting, rows: list[Row]) -> list[str]:
    """ppo.rollout.engine=vllm: the engine's memory per engine GPU, and beside the trainer on a shared GPU (rl.py)."""
    engine = engine_setup(cfg, st.precision)
    if engine is None:
        return []
    memory = engine_memory(engine_model(cfg, st.facts), engine, st.gpu, samples=st.rl.samples, seq=st.seq)
    training = [(r.layout.name, r.device_bytes, sum(s.device for s in r.states.values())) for r in rows]
    return engine_lines(engine, memory, st.gpu, training, USABLE)


def longest_sequence_lines(st: Setting, layouts: list[Layout], rows: dict[str, int]) -> list[str]:
    """Per backend of the table, the longest data.max_seq_len that fits at micro-batch 1 (at the run's row-sharing
    degrees `rows`, sp and cp: a compared preset that has them was taken to them, ddp has none)."""
    lines, most = [], 0
    for layout in layouts:
        longest = longest_sequence(st, layout)
        most = max(most, longest)
        if not longest:
            lines.append(f"{layout.name}: not even data.max_seq_len={layout.sp} fits at micro-batch 1 (the model "
                         "states alone are too much)")
            continue
        split = " × ".join(f"{name} {degree}" for name, degree in (("cp", layout.cp), ("sp", layout.sp)) if degree > 1)
        per_rank = f" ({split}: {-(-longest // layout.row_split):,} tokens of each row per rank)" if split \
            else f" (no {' or '.join(rows)})" if rows else ""
        at_least = "at least " if longest >= SEQ_SEARCH_LIMIT else ""
        lines.append(f"{layout.name}: longest data.max_seq_len that fits at micro-batch 1: {at_least}{longest:,}"
                     f"{per_rank}")
    positions = st.facts.max_positions
    if positions and most > positions:
        lines.append(f"(memory only: this model's config says max_position_embeddings={positions:,}; longer rows need "
                     "a checkpoint or rope scaling trained for them)")
    return lines


def batch_arithmetic(cfg: DictConfig, world: int) -> str:
    """The global batch of one step, in the stage's units, over this world's data-parallel size."""
    t, spec = cfg.trainer, stage_spec(cfg.stage.name)
    dp = data_parallel_size(cfg.backend, world)
    if spec.rl_shape is not None:
        it = spec.rl_shape(cfg)
        return (f"one step: {it.prompts_per_step} prompts × {it.samples_per_prompt} samples = {it.samples} "
                f"sequences (≤ {it.max_new_tokens} new tokens each) over dp {dp}, then {it.epochs} epoch(s) of "
                f"mini-batches of {it.mini_batch}: {it.epochs * (it.samples // max(it.mini_batch, 1))} optimizer "
                f"steps per step (the lr schedule counts these), forwards of {t.micro_batch_size} sequences per rank")
    rows = t.micro_batch_size * t.grad_accum_steps * dp
    unit = "pairs" if spec.pairs else "rows"  # a pair is two sequences in one forward
    return (f"global batch {rows} {unit} = micro_batch_size {t.micro_batch_size} × grad_accum_steps "
            f"{t.grad_accum_steps} × dp {dp} (≤ {rows * cfg.data.max_seq_len * spec.sequences_per_sample} tokens at "
            f"max_seq_len {cfg.data.max_seq_len})")


def dry_run_world(cfg: DictConfig, world: int) -> int:
    """The world a dry run plans: `plan.world_size` when set (validated for it: a one-process dry run of a recipe
    sized for 8 GPUs plans 8), else the current one. A real run always plans its own world (the fit check, the live
    cost)."""
    planned = cfg.plan.world_size if cfg.dry_run and cfg.plan.world_size else world
    if planned != world:
        if planned < 1:
            raise ConfigError(f"plan.world_size={planned} must be >= 1 (the number of ranks to plan for)")
        validate(cfg, planned)
        check_backend_against_model(cfg, planned)
    return planned


def plan_run(cfg: DictConfig, world: int, device, precision: str) -> RunPlan:
    """The run's own summary lines, then the plan of its backend on this world and device (dry_run=true prints it;
    a dry run with plan.world_size plans that world: `dry_run_world`)."""
    current, world = world, dry_run_world(cfg, world)
    facts = model_facts(cfg)
    gpu = resolve_gpu(cfg.plan, device.type, world)
    layout = layout_of(row_name(cfg.backend), cfg.backend, world, facts.hidden)
    st = setting(cfg, world, gpu, precision, facts)
    row = plan_row(st, layout)
    dp, stage = data_parallel_size(cfg.backend, world), layout.stage
    mixed = precision in ("bf16", "fp16")
    # LoRA: the adapters (and modules_to_save copies) come on top of a base that is frozen whole: weights only
    trainable, frozen = (st.lora, facts.params) if st.lora else (facts.params, 0)
    frozen_elem = frozen_elem_bytes(spec_of(cfg.backend).frozen_in_compute_dtype, mixed)
    state = planned_state_bytes(trainable=trainable, frozen=frozen, stage=stage, dp=layout.shards,  # ZeRO: dp × sp
                                mixed_precision=mixed, frozen_elem_bytes=frozen_elem)
    lines = [f"recipe {cfg.recipe}: stage {cfg.stage.name}, backend {cfg.backend.name}, precision {precision} "
             f"on {device.type}, world {world}"
             f"{f' (plan.world_size; this process: world {current})' if world != current else ''}",
             f"model {facts.label}: {facts.params / 1e6:,.1f}M parameters (L={facts.layers}, h={facts.hidden}, "
             f"heads={facts.heads}, vocab={facts.vocab})",
             f"training FLOPs ≈ 6·M + 12·L·h·s = "
             f"{human(training_flops_per_token(facts.params, facts.layers, facts.hidden, st.seq), 'FLOP')} per token "
             f"at s={st.seq}",
             f"model states ({precision} Adam, {cfg.backend.name}, sharding as ZeRO stage {stage}, dp {dp}"
             f"{f' × cp {layout.cp}' if layout.cp > 1 else ''}{f' × sp {layout.sp}' if layout.sp > 1 else ''}"
             f"{'' if not st.lora else f'; LoRA: {st.lora:,} trainable, the base as weights only'}) ≈ "
             f"{human(state, 'B', 1024)} per rank per trainable role (activations not included)",
             roles_summary(st, row), batch_arithmetic(cfg, world),
             f"{cfg.trainer.max_steps} steps, output_dir {cfg.output_dir}", ""]
    text = "\n".join(lines + describe(cfg, world, gpu, precision, facts))
    p2p = pipeline_p2p(cfg.backend, rows=st.micro * st.rows_per_sample, accum=st.accum, seq=st.seq,
                       hidden=st.facts.hidden, precision=st.precision)
    pipeline = pipeline_figures(st, layout, pipeline_layout(cfg.backend, facts, accum=st.accum, seq=st.seq), dp)
    return RunPlan(text=text, figures=plan_figures(st, row, gpu, precision, p2p, pipeline), setting=st, row=row,
                   gpu=gpu)


def plan_text(cfg: DictConfig) -> str:
    """`python -m llmtrain.plan`: validate for the planned world, then the plan."""
    from llmtrain.distributed import env_world_size, resolve_device

    world = cfg.plan.world_size or env_world_size()
    if world < 1:
        raise ConfigError(f"plan.world_size={world} must be >= 1 (the number of ranks to plan for)")
    if not 0 < cfg.plan.mfu <= 1:
        raise ConfigError(f"plan.mfu={cfg.plan.mfu} must be in (0, 1] (typical 0.3-0.5)")
    validate(cfg, world)
    check_backend_against_model(cfg, world)
    gpu = resolve_gpu(cfg.plan, resolve_device(cfg.device).type, world)
    return "\n".join(describe(cfg, world, gpu, plan_precision(cfg, gpu)))


def main(argv: list[str] | None = None) -> int:
    from llmtrain.compose import compose_config

    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        print(plan_text(compose_config(args)), flush=True)
    except (ConfigError, FileNotFoundError) as error:
        print(f"llmtrain.plan: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0

