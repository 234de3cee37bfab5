"""Predicted cost per rank before a run: model-state bytes as each backend really holds them, activations,
logits, communication per step and step time. Pure arithmetic on counts (docs/formulas.md, "The planner");
`llmtrain.plan` reads the counts from the model on the meta device and prints them.

Symbols: T trainable and F frozen parameters of one role (F: a LoRA base, or a whole frozen role), N data-parallel
ranks, t tensor-parallel degree, P parameters ZeRO-3 keeps whole (numel <= its persistence threshold), w bytes per
element of the 16-bit working copy (2 under bf16/fp16, 4 in fp32). Bytes are per rank. What each backend holds:
- DDP: fp32 weights 4(T+F), fp32 gradients 4T (bucket views, no second copy), Adam 8T; under bf16 autocast caches
  a 16-bit copy of every trainable weight from forward to backward (2T "gathered").
- DeepSpeed: 16-bit weights w(T+F) (fp32: 4); an fp32 master partition 4T/N at ZeRO-1/2/3 also in fp32 runs;
  gradients fp32 (bf16_gradient_dtypes): ZeRO-1 whole 4T under bf16 (BF16_Optimizer) or with accumulation,
  ZeRO-2/3 a 4T/N partition; ZeRO-0 keeps 16-bit gradients 2T and a whole fp32 master 4T under bf16. ZeRO-3
  weights w((T+F)/N + P), plus the modules gathered at once. Offload puts master + Adam (+ ZeRO-3 gradients) and,
  with parameter offload, the ZeRO-3 weight partitions in host memory or on NVMe.
- FSDP2: fp32 shards 4(T+F)/N (the optimizer's masters: no separate copy), fp32 gradient shards 4T/N, Adam 8T/N,
  and the unsharded 16-bit blocks being computed. With accumulation (no_sync) gradients and weights stay unsharded
  between micro-batches: 4T whole gradients and every weight gathered. TP splits the fraction of parameters its
  plan covers by t.
"""

from __future__ import annotations

from dataclasses import dataclass

GB, GIB = 1e9, 2 ** 30
OFF_DEVICE = ("cpu", "nvme")


@dataclass(frozen=True)
class Layout:
    """How one backend places a role on a rank."""
    name: str  # the row's name: ddp, zero0..zero3, zero3_offload, fsdp2, fsdp2_tp
    library: str  # ddp | deepspeed | fsdp2
    stage: int  # what is sharded: 0 nothing, 1 optimizer state, 2 + gradients, 3 + weights (FSDP2: 3)
    dp: int
    tp: int = 1
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (FSDP2 cpu_offload: cpu)
    persistence_threshold: int = 0  # ZeRO-3: parameters with numel <= this stay whole on every rank
    reshard_after_forward: bool = True  # FSDP2: blocks resharded after forward (gathered again for backward)


@dataclass(frozen=True)
class RoleParams:
    """Parameter counts of one role as a layout sees them."""
    trainable: int
    frozen: int = 0
    persistent: int = 0  # ZeRO-3: numel of the parameters kept whole (P)
    tp_fraction: float = 0.0  # share of the parameters the TP plan splits (q/k/v/o, gate/up/down)
    working: int = 0  # parameters gathered whole at once under ZeRO-3/FSDP2 (two blocks + the largest other module)
    regathered: float | None = None  # ZeRO-3: parameters gathered again in backward (None: every partitioned one)
    block_fraction: float = 1.0  # share of the parameters in decoder blocks (FSDP2 reshards those, not the root)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per rank of one role's model states; `host`/`nvme` are the parts offload keeps off the device."""
    weights: float
    master: float
    grads: float
    optim: float
    gathered: float  # 16-bit working copies (autocast cache, ZeRO-3 / FSDP2 all-gathered modules)
    host: float = 0.0
    nvme: float = 0.0

    @property
    def held(self) -> float:
        return self.weights + self.master + self.grads + self.optim + self.gathered

    @property
    def device(self) -> float:
        return self.held - self.host - self.nvme


def _elem(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else 4


def _ddp(r: RoleParams, lay: Layout, precision: str, accum: int) -> StateBytes:
    t, f = r.trainable, r.frozen
    return StateBytes(weights=4 * (t + f), master=0.0, grads=4 * t, optim=8 * t,
                      gathered=2 * t if _elem(precision) == 2 else 0.0)


def _deepspeed(r: RoleParams, lay: Layout, precision: str, accum: int) -> StateBytes:
    t, f, n, w, mixed = r.trainable, r.frozen, lay.dp, _elem(precision), _elem(precision) == 2
    if lay.stage == 0:
        return StateBytes(weights=w * (t + f), master=4 * t if mixed else 0.0, grads=w * t, optim=8 * t, gathered=0.0)
    whole_grads = lay.stage == 1 and (mixed or accum > 1)
    s = StateBytes(weights=w * ((t + f) / n + r.persistent) if lay.stage == 3 else w * (t + f), master=4 * t / n,
                   grads=4 * t if whole_grads else 4 * t / n, optim=8 * t / n,
                   gathered=w * r.working if lay.stage == 3 else 0.0)
    off = {"cpu": 0.0, "nvme": 0.0}
    if lay.offload_optimizer in OFF_DEVICE:
        off[lay.offload_optimizer] += s.master + s.optim + (s.grads if lay.stage == 3 else 0.0)
    if lay.offload_param in OFF_DEVICE and lay.stage == 3:
        off[lay.offload_param] += w * (t + f) / n
    return StateBytes(s.weights, s.master, s.grads, s.optim, s.gathered, host=off["cpu"], nvme=off["nvme"])


def _fsdp2(r: RoleParams, lay: Layout, precision: str, accum: int, on_gpu: bool = True) -> StateBytes:
    """fp32 shards always; the MixedPrecisionPolicy (bf16 gathers) on a GPU with bf16 only (backends/fsdp2.py)."""
    split = 1 - r.tp_fraction + r.tp_fraction / lay.tp  # per-rank share after TP

    t, f, n = r.trainable * split, r.frozen * split, lay.dp
    w = 2 if on_gpu and precision == "bf16" else 4
    unsharded = accum > 1 and t > 0  # no_sync: gradients and weights kept whole between micro-batches
    s = StateBytes(weights=4 * (t + f) / n, master=0.0, grads=4 * t if unsharded else 4 * t / n, optim=8 * t / n,
                   gathered=w * (t + f) if unsharded else w * r.working * split)
    if lay.offload_param == "cpu":  # CPUOffloadPolicy: shards, gradients and the optimizer step on the host
        return StateBytes(s.weights, s.master, s.grads, s.optim, s.gathered, host=s.weights + s.grads + s.optim)
    return s


HOLDINGS = {"ddp": _ddp, "deepspeed": _deepspeed, "fsdp2": _fsdp2}


def state_bytes(role: RoleParams, layout: Layout, precision: str, grad_accum_steps: int = 1,
                on_gpu: bool = True) -> StateBytes:
    """One role's model states on one rank as `layout.library` holds them (module docstring). A frozen role is
    trainable=0: weights only (compute dtype under DeepSpeed, fp32 under DDP/FSDP2), sharded at stage 3."""
    if layout.library == "fsdp2":
        return _fsdp2(role, layout, precision, grad_accum_steps, on_gpu)
    return HOLDINGS[layout.library](role, layout, precision, grad_accum_steps)


def activation_bytes_per_layer(b: int, s: int, h: int, a: int, *, tp: int = 1, elem: int = 2,
                               scores: bool = True) -> float:
    """Korthikanti et al. 2022, bytes one block keeps for backward: s·b·h·(10 + 24/t) + 5·a·s²·b/t in 16-bit
    (34·s·b·h + 5·a·s²·b at t = 1), × elem/2. `scores=False` drops 5·a·s²·b (the QKᵀ scores, softmax and its
    dropout mask): sdpa / flash / flex attention never store the (b, a, s, s) tensors, only a (b, a, s) logsumexp,
    and recompute the scores in backward."""
    per = s * b * h * (10 + 24 / tp) + (5 * a * s * s * b / tp if scores else 0.0)
    return per * elem / 2


def gated_activation_bytes_per_layer(b: int, s: int, h: int, a: int, *, intermediate: int, kv_heads: int,
                                     tp: int = 1, elem: int = 2, scores: bool = True) -> float:
    """A Llama-style block (RMSNorm, GQA, rotary, SwiGLU MLP, no dropout), counted from what autograd saves (measured
    with saved-tensor hooks, metrics/live.py): per token, two RMSNorms keep their input, the normalised and the
    weighted output (3h) and 1/rms (1) each — the input of the second is the attention residual, of the first the
    block input; attention keeps rotated q (h), k and v (2·kv, GQA unrepeated), its output (h, o_proj's input too)
    and a logsumexp per head (a); the MLP keeps gate, up, silu(gate) and their product (4i).
    → s·b·(8h + 2kv + 4i/t + a + 2) elements (TP splits the MLP and heads), × elem bytes; eager attention adds the
    (b, a, s, s) probabilities (a·s per token). GPT's 34·s·b·h (16-bit) assumes a 4h GELU MLP and dropout masks;
    for the tiny Llama (h 128, i 384) this count is 1.27× it, and matches the measured bytes to 0.01 %."""
    kv = kv_heads * (h // a)
    per_token = 8 * h + 2 * kv + (4 * intermediate + a) / tp + 2 + (a * s / tp if scores else 0.0)
    return s * b * per_token * elem


def activation_bytes(b: int, s: int, h: int, a: int, layers: int, *, checkpointing: bool, tp: int = 1,
                     elem: int = 2, scores: bool = True, intermediate: int | None = None,
                     kv_heads: int | None = None) -> float:
    """All layers, plus the embedding output (2·s·b·h). Checkpointing keeps each block's input (2·s·b·h) and, in
    backward, one block's full activations at a time (its recompute). With `intermediate` (a gated, Llama-style
    block) the layer is `gated_activation_bytes_per_layer`, whose count holds the block input already, and the final
    RMSNorm adds its input, normalised and weighted output and 1/rms: s·b·(3h + 1)."""
    block_input = 2 * s * b * h * elem / 2
    if intermediate:
        layer = gated_activation_bytes_per_layer(b, s, h, a, intermediate=intermediate, kv_heads=kv_heads or a,
                                                 tp=tp, elem=elem, scores=scores)
        outside = s * b * (3 * h + 1) * elem
        return (layers * block_input + layer if checkpointing else layers * layer) + outside
    layer = activation_bytes_per_layer(b, s, h, a, tp=tp, elem=elem, scores=scores)
    kept = layers * block_input + layer if checkpointing else layers * layer
    return kept + block_input


def logits_bytes(b: int, s: int, vocab: int) -> float:
    """The (b, s, V) logits in fp32 for the loss: b·s·V·4 (their gradient, as large, is not counted)."""
    return 4.0 * b * s * vocab


@dataclass(frozen=True)
class Collective:
    what: str
    kind: str  # all_reduce | all_gather | reduce_scatter | reduce
    payload: float  # bytes of the full tensor handed to one call
    group: int  # ranks taking part
    times: int = 1  # calls per optimizer step
    overlapped: bool = True  # hidden behind compute (dp traffic); TP's all-reduces are on the critical path

    @property
    def wire(self) -> float:
        """Ring bytes each rank sends: (g-1)/g of the payload, twice for an all-reduce."""
        if self.group <= 1:
            return 0.0
        return (2 if self.kind == "all_reduce" else 1) * (self.group - 1) / self.group * self.payload * self.times


def communication(role: RoleParams, layout: Layout, precision: str, *, accum: int, tokens_per_micro: int,
                  hidden: int, layers: int, checkpointing: bool, on_gpu: bool = True) -> list[Collective]:
    """Collectives of one optimizer step for one role (trainable or frozen), from docs/formulas.md's table."""
    t, f, n, w, k = role.trainable, role.frozen, layout.dp, _elem(precision), accum
    g = 4 if precision in ("bf16", "fp32") else 2  # gradients travel in fp32 under bf16 (bf16_gradient_dtypes)
    lib, stage, out = layout.library, layout.stage, []
    if lib == "ddp" or (lib == "deepspeed" and stage == 0):
        out.append(Collective("gradients", "all_reduce", (4 if lib == "ddp" else g) * t, n))
    elif lib == "deepspeed" and stage in (1, 2):
        bf16_zero1 = stage == 1 and precision == "bf16"
        out.append(Collective("gradients", "all_reduce" if bf16_zero1 else "reduce", g * t, n, k if stage == 2 else 1))
        out.append(Collective("updated weights", "all_gather", w * t, n))
    elif lib == "deepspeed":  # ZeRO-3: persistent parameters are never gathered
        gathered = w * max(0.0, t + f - role.persistent)
        again = gathered if role.regathered is None else w * role.regathered
        out.append(Collective("weights, forward", "all_gather", gathered, n, k))
        if t and again:
            out.append(Collective("weights, backward", "all_gather", again, n, k))
        if t:
            out.append(Collective("gradients", "reduce_scatter", g * t, n, k))
    else:  # FSDP2: the root (embeddings, head) is not resharded after forward; gradients reduce on the last micro
        split = 1 - role.tp_fraction + role.tp_fraction / layout.tp
        wg = 2 if on_gpu and precision == "bf16" else 4
        whole, blocks = wg * (t + f) * split, wg * (t + f) * split * role.block_fraction
        if t:  # no_sync keeps every unit gathered after each backward but the last's: one forward gather a step;
            # blocks resharded after each forward are gathered again in each backward (measured, tests/dist)
            out.append(Collective("weights, forward", "all_gather", whole, n))
            if layout.reshard_after_forward:
                out.append(Collective("weights, backward", "all_gather", blocks, n, k))
            out.append(Collective("gradients", "reduce_scatter", 4 * t * split, n))
        else:
            out.append(Collective("weights, forward", "all_gather", whole, n, k))
    if layout.tp > 1:  # Megatron: 2 all-reduces of the (b·s, h) activations forward, 2 backward, per block
        per_block = (4 if t else 2) + (2 if checkpointing and t else 0)  # recompute repeats the forward two
        out.append(Collective("TP activations", "all_reduce", w * tokens_per_micro * hidden, layout.tp,
                              per_block * layers * k, overlapped=False))
    return out


ZERO3_MAX_REUSE_DISTANCE = 1e9  # DeepSpeed's stage3_max_reuse_distance default (numel); llmtrain does not set it


def zero3_regathered(layers: int, block: int, embed: int, head: int,
                     reuse_distance: float = ZERO3_MAX_REUSE_DISTANCE) -> float:
    """Parameters ZeRO-3 gathers again for backward. After a module's forward DeepSpeed keeps its parameters when
    they are used again within `reuse_distance` numel of the recorded trace: block l's next use is its own
    backward, 2·(L-1-l)·B + 2·head numel later; the embedding's 2·L·B + 2·head later; the head's at once. A model
    smaller than the distance (the tiny test models) is gathered once per micro-batch; for Llama-2-7B blocks 0-29 and
    the embedding are gathered again, blocks 30-31 and the head are not (counted in tests/dist, live)."""
    again = sum(block for layer in range(layers) if 2 * (layers - 1 - layer) * block + 2 * head >= reuse_distance)
    return again + (embed if 2 * layers * block + 2 * head >= reuse_distance else 0)


def step_seconds(hardware_flops: float, collectives: list[Collective], *, peak_flops: float, mfu: float,
                 link_bytes_per_s: float) -> dict[str, float]:
    """Compute at `mfu` of the peak; data-parallel traffic at the link bandwidth, overlapped with compute
    (DDP buckets, ZeRO/FSDP prefetch): step = max(compute, dp comm) + TP comm (on the critical path)."""
    compute = hardware_flops / (peak_flops * mfu)
    hidden = sum(c.wire for c in collectives if c.overlapped) / link_bytes_per_s
    exposed = sum(c.wire for c in collectives if not c.overlapped) / link_bytes_per_s
    return {"compute_s": compute, "comm_s": hidden + exposed, "step_s": max(compute, hidden) + exposed}
