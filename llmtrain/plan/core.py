"""The planner's figures: per role and backend, the bytes each rank holds (weights, gradients, optimizer state,
gathered copies, activations, logits), the largest micro-batch and the longest sequence that fit, communication,
FLOPs and step time, from a `Setting` (setting.py: the resolved config and the model's facts on the meta device).
report.py prints them; the live cost (metrics/live.py) compares the run with figures.py's `plan_figures`.
docs/formulas.md, "The planner", has every formula."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from omegaconf import DictConfig

from llmtrain.backends import compared_presets, spec_of
from llmtrain.config import ConfigError
from llmtrain.metrics.cost import (
    GIB,
    Collective,
    Layout,
    RoleParams,
    StateBytes,
    activation_bytes,
    communication,
    fused_head_bytes,
    logits_bytes,
    state_bytes,
    step_seconds,
)
from llmtrain.metrics.flops import training_flops_per_token
from llmtrain.metrics.memory import planned_model_state_bytes
from llmtrain.models.facts import ModelFacts
from llmtrain.parallel.dimension import dimension_collectives
from llmtrain.plan.rl import rl_communication, rl_flops
from llmtrain.plan.setting import Setting

COMPARED = compared_presets()  # plan.compare_backends: each backend descriptor's rows
USABLE = 0.92  # of device memory: the CUDA context, NCCL and DeepSpeed buckets, fragmentation take the rest


def role_params(facts: ModelFacts, layout: Layout, trainable: bool, lora: int, view: bool = False,
                scalar_head: bool = False, head_split: int = 1, optim_floats: float = 2.0,
                muon_share: float = 0.0) -> RoleParams:
    """(trainable, frozen) of one role: all of it, a LoRA split (adapters trainable, base frozen), or frozen; a view
    (LoRA's reference: the policy with adapters disabled) holds nothing of its own; a scalar head (reward model,
    critic) replaces an untied LM head with a (1, hidden) score. head_split > 1: the LM head's rows are split over
    tp as the TP plan's layers are (vocab_split).
    The numbers only: metrics/cost.py takes any (trainable, frozen) pair, so a LoRA counter elsewhere plugs in."""
    params = facts.params - facts.head + facts.hidden if scalar_head else facts.params
    t, f = (lora, params) if trainable and lora else (params, 0) if trainable else (0, params)
    if view:
        t, f = 0, 0
    numels = [*facts.numels, facts.hidden] if scalar_head else facts.numels  # the LM head is never persistent
    persistent = sum(n for n in numels if n <= layout.persistence_threshold) if layout.stage == 3 else 0
    working, regathered = layout.backend.gathers(layout, facts)  # at once; again in backward (ZeRO-3's trace)
    regathered = regathered if t or f else None
    tp_params = facts.tp_params + (facts.head if head_split > 1 else 0)
    experts = facts.expert_params if layout.ep > 1 else 0  # under ep the experts leave tp's plan for ep's split
    return RoleParams(trainable=t, frozen=f, persistent=persistent,
                      tp_fraction=(tp_params - min(experts, facts.tp_expert_params)) / facts.params, working=working,
                      regathered=regathered, expert_fraction=experts / facts.params, optim_floats=optim_floats,
                      muon_fraction=muon_share if t else 0.0,
                      block_fraction=(facts.layers * facts.block - experts) / (facts.params - experts))


def layout_of(name: str, backend, world: int, hidden: int) -> Layout:
    """A Layout from a backend config node (its descriptor's `layout` on its ParallelDims); ConfigError when its
    degrees do not fit the world."""
    spec = spec_of(backend)
    return spec.layout(name, backend, spec.parallel_dims(backend, world), hidden)


def row_name(backend) -> str:
    """The preset a backend config node is (its descriptor says): the row's name."""
    return spec_of(backend).row_name(backend)


def preset_backends() -> dict:
    """The shipped presets compared (conf/backend/NAME.yaml composed onto the schema)."""
    from hydra import compose, initialize_config_dir

    from llmtrain.paths import conf_dir
    from llmtrain.schema import register_schema

    register_schema()
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return {name: compose("config", overrides=[f"backend={name}"]).backend for name in COMPARED}


@dataclass
class Row:
    layout: Layout
    states: dict[str, StateBytes]
    activations: float
    logits: float
    device_bytes: float
    fits: bool
    max_micro: int
    comm: list[Collective] = field(default_factory=list)
    times: dict[str, float] | None = None
    textbook: float = 0.0


def _per_micro(st: Setting, layout: Layout, b: int) -> tuple[float, float]:
    """(activations, logits) per rank of every trainable role at micro-batch b."""
    rows, elem = b * st.rows_per_sample, 2 if st.precision in ("bf16", "fp16") else 4
    f = st.facts
    trainable = sum(st.roles.values())
    seq = -(-st.seq // layout.row_split)  # context / sequence parallelism: each rank's shard of every row
    act = activation_bytes(rows, seq, f.hidden, f.heads, f.layers, checkpointing=st.checkpointing,
                           tp=layout.tp, elem=elem, scores=st.scores, intermediate=f.mlp_width, kv_heads=f.kv_heads,
                           softcapping=f.softcapping, concat_outputs=st.concat_outputs)
    return trainable * act, trainable * head_bytes(st, rows, seq, vocab_split(st, layout))[1]


def vocab_split(st: Setting, layout: Layout, role: str | None = None) -> int:
    """The tp ranks the LM head's rows are split over (models/vocab_parallel.py): the fused head (model.fused_loss
    on), untied, on a layout that splits it (FSDP2 with tp, no pp); 1 for full logits, a tied head, a scalar head."""
    if st.head_chunk is None or not st.facts.head or role in st.scalar_heads:
        return 1
    return layout.head_tp


def head_bytes(st: Setting, rows: int, seq: int, split: int = 1) -> tuple[float, float]:
    """The LM head and loss of one forward: (what autograd holds to the backward, the peak). Full logits: b·s·V·4
    both (the log-softmax cross-entropy saves); fused: metrics/cost.fused_head_bytes, with ⌈V/tp⌉ rows per rank when
    the head is split over the vocabulary (`split`: each chunk's logits, the held weight gradient). RL sends only the
    response positions to the head (logits_to_keep)."""
    seq = min(seq, st.head_positions or seq)
    if not st.fused_head:
        full = logits_bytes(rows, seq, st.logits_vocab)
        return full, full
    return fused_head_bytes(rows, seq, -(-st.logits_vocab // split), st.facts.hidden, st.head_chunk, st.head_loss_sum)


def largest_micro_batch(fixed: float, per_micro, usable: float, limit: int = 1 << 16) -> int:
    """The largest b with fixed + per_micro(b) <= usable (0: not even 1); doubling, then bisection."""
    if fixed + per_micro(1) > usable:
        return 0
    low, high = 1, 2
    while high <= limit and fixed + per_micro(high) <= usable:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fixed + per_micro(mid) <= usable else (low, mid)
    return low


SEQ_SEARCH_LIMIT = 1 << 24  # the longest-sequence search stops doubling at 16M tokens


def longest_sequence(st: Setting, layout: Layout) -> int:
    """The longest data.max_seq_len whose micro-batch of 1 fits this layout on the device (0: not even one token per
    rank): the states do not grow with s, activations and logits do (each sp rank holds s/sp of every row), so it is
    the micro-batch search over s."""
    one = replace(st, micro=1)
    fixed = sum(s.device for s in _role_states(one, layout)[1].values())
    return largest_micro_batch(fixed, lambda seq: sum(_per_micro(replace(one, seq=seq), layout, 1)),
                               st.gpu.memory_gib * GIB * USABLE, limit=SEQ_SEARCH_LIMIT)


def _role_states(st: Setting, layout: Layout) -> tuple[dict, dict]:
    """({role: (RoleParams, trainable)}, {role: StateBytes}) of every role on this layout."""
    f, on_gpu = st.facts, st.gpu.name != "cpu"
    params = {role: (role_params(f, layout, trainable, st.lora, role in st.views, role in st.scalar_heads,
                                 vocab_split(st, layout, role), st.optim_floats, st.muon_share), trainable)
              for role, trainable in st.roles.items()}
    return params, {role: state_bytes(p, layout, st.precision, st.accum, on_gpu) for role, (p, _) in params.items()}


def plan_row(st: Setting, layout: Layout) -> Row:
    f, on_gpu = st.facts, st.gpu.name != "cpu"
    params, states = _role_states(st, layout)
    fixed = sum(s.device for s in states.values())
    act, logit = _per_micro(st, layout, st.micro)
    usable = st.gpu.memory_gib * GIB * USABLE
    device = fixed + act + logit
    tokens = st.micro * -(-st.seq // layout.row_split) * st.rows_per_sample  # this rank's: s/(cp·sp) of each row
    shape = dict(tokens_per_micro=tokens, hidden=f.hidden, layers=f.layers, checkpointing=st.checkpointing,
                 on_gpu=on_gpu)
    if st.rl is not None:
        comm = rl_communication(params, layout, st.precision, st.rl.schedule(layout.dp), **shape)
    else:
        comm = [c for p, _ in params.values() for c in communication(p, layout, st.precision, accum=st.accum, **shape)]
        comm += [c for trainable in st.roles.values() for c in dimension_collectives(
            layout, f, st.precision, tokens_per_micro=tokens, accum=st.accum, trainable=trainable,
            checkpointing=st.checkpointing)]
    times = None
    if st.gpu.peak_tflops:
        model, hardware = step_flops(st, layout)
        times = step_seconds(hardware / st.world, comm, peak_flops=st.gpu.peak_tflops * 1e12, mfu=st.mfu,
                             link_bytes_per_s=st.gpu.link_gb_per_s * 1e9)
        times["mfu"] = model / st.world / (times["step_s"] * st.gpu.peak_tflops * 1e12)
    textbook = sum(planned_model_state_bytes(num_params=st.lora or f.params, stage=layout.stage, dp=layout.shards,
                                             mixed_precision=st.precision in ("bf16", "fp16"))
                   for trainable in st.roles.values() if trainable)
    return Row(layout, states, act, logit, device, device <= usable,
               largest_micro_batch(fixed, lambda b: sum(_per_micro(st, layout, b)), usable), comm, times, textbook)


def step_flops(st: Setting, layout: Layout) -> tuple[float, float]:
    """(model, hardware) FLOPs of one optimizer step over all ranks: 6·M + 12·L·h·s per token per trainable
    role, 2·M + 4·L·h·s per frozen one (forward only); checkpointing adds one forward of the blocks to hardware."""
    f = st.facts
    trainable = sum(st.roles.values())
    if st.rl is not None:  # an iteration: generation, experience forwards, epochs of updates (plan.rl.rl_flops)
        model = rl_flops(st.rl, st.roles, f.params, f.layers, f.hidden, st.seq)
        trained_tokens = st.rl.epochs * st.rl.samples * st.seq
    else:
        tokens = st.micro * st.accum * layout.dp * st.seq * st.rows_per_sample
        train = training_flops_per_token(f.params, f.layers, f.hidden, st.seq)
        model = tokens * (trainable * train + (len(st.roles) - trainable) * train / 3)
        trained_tokens = tokens
    recompute = trained_tokens * trainable * (2 * f.layers * f.block + 4 * f.layers * f.hidden * st.seq)
    return model, model + (recompute if st.checkpointing else 0.0)


def plan_rows(st: Setting, layouts: list[Layout]) -> list[Row]:
    return [plan_row(st, layout) for layout in layouts]


def compared_layouts(cfg: DictConfig, world: int, facts: ModelFacts,
                     rows: dict[str, int] | None = None) -> tuple[list[Layout], list[str]]:
    """Every preset that fits this world and model, and a note per one that does not; with `rows` (the run's
    row-sharing degrees above 1: parallel.row_degrees, e.g. {"cp": 2, "sp": 2}), each preset whose backend has those
    fields at those degrees (a backend without one compares unsplit)."""
    from omegaconf import OmegaConf

    from llmtrain.backends import backend_plan_problems
    from llmtrain.models.lora_checks import peft_problems
    from llmtrain.validation import backend_problems

    layouts, notes = [], []
    for name, backend in preset_backends().items():
        shared = {name: n for name, n in (rows or {}).items() if name in spec_of(backend).fields()}
        if shared:
            backend = OmegaConf.merge(backend, shared)
        problems = backend_problems(backend, world) + peft_problems(cfg.peft, backend)
        problems = problems or backend_plan_problems(backend, world, facts)
        if problems:
            notes.append(f"{name}: left out ({'; '.join(problems)})")
            continue
        layouts.append(layout_of(name, backend, world, facts.hidden))
    return layouts, notes


def check_backend_against_model(cfg: DictConfig, world: int) -> None:
    """The backend's checks that need the model's architecture (heads, kv-heads: config.json, no weights)."""
    from llmtrain.backends import backend_model_problems
    from llmtrain.models.load import model_config

    m = cfg.model
    problems = backend_model_problems(cfg.backend, world, lambda: model_config(
        m.name_or_path, m.from_config, m.config_path, m.trust_remote_code))
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))

