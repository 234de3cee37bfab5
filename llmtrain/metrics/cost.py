"""Predicted cost per rank before a run: model-state bytes as each backend really holds them, activations,
logits, communication per step and step time. Pure arithmetic on counts (docs/formulas.md, "The planner");
`llmtrain.plan` reads the counts from the model on the meta device and prints them.

Symbols: T trainable and F frozen parameters of one role (F: a LoRA base, or a whole frozen role), N data-parallel
ranks, t tensor-parallel degree, P parameters ZeRO-3 keeps whole (numel <= its persistence threshold), w bytes per
element of the 16-bit working copy (2 under bf16/fp16, 4 in fp32). Bytes are per rank. What each backend holds
and moves is its own descriptor's figure (`holdings`, `collectives` of llmtrain/backends/<name>_spec.py, each
module's docstring says it), which `state_bytes` and `communication` call through the Layout's `backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB, GIB = 1e9, 2 ** 30
OFF_DEVICE = ("cpu", "nvme")


@dataclass(frozen=True)
class Layout:
    """How one backend places a role on a rank."""
    name: str  # the row's name: the preset it is (zero3_offload, fsdp2_tp, ...)
    backend: Any  # the backend's descriptor (llmtrain.backends.BACKENDS): its `holdings` and `collectives`
    stage: int  # what is sharded: 0 nothing, 1 optimizer state, 2 + gradients, 3 + weights (FSDP2: 3)
    dp: int
    tp: int = 1
    sp: int = 1  # sequence-parallel peers: share each row (s/sp tokens each), hold the same weights as dp peers
    cp: int = 1  # context-parallel peers (ring attention): share each row as sp peers do
    ep: int = 1  # expert-parallel peers: each holds E/ep experts (carved from dp_shard × tp: dp unchanged)
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (FSDP2 cpu_offload: cpu)
    persistence_threshold: int = 0  # ZeRO-3: parameters with numel <= this stay whole on every rank
    reshard_after_forward: bool = True  # FSDP2: blocks resharded after forward (gathered again for backward)
    head_tp: int = 1  # tp ranks a fused, untied LM head's rows are split over (FSDP2 with tp, no pp: vocab_parallel)


    @property
    def shards(self) -> int:
        """Ranks a ZeRO / FSDP backend shards over and reduces gradients across: dp × cp × sp."""
        return self.dp * self.sp * self.cp

    @property
    def row_split(self) -> int:
        """Ranks sharing each row, s/(cp·sp) tokens each: context × sequence parallel."""
        return self.cp * self.sp

    @property
    def efsdp(self) -> int:
        """Under ep, the ranks holding the same experts, which FSDP-shard them: dp_shard · tp / ep (ep refuses
        dp_replicate and sp, so dp is dp_shard; models/expert_parallel.efsdp_size)."""
        return max(1, self.dp * self.tp // self.ep)


@dataclass(frozen=True)
class RoleParams:
    """Parameter counts of one role as a layout sees them."""
    trainable: int
    frozen: int = 0
    persistent: int = 0  # ZeRO-3: numel of the parameters kept whole (P)
    tp_fraction: float = 0.0  # share of the parameters the TP plan splits (q/k/v/o, gate/up/down)
    working: int = 0  # parameters gathered whole at once under ZeRO-3/FSDP2 (two blocks + the largest other module)
    regathered: float | None = None  # ZeRO-3: parameters gathered again in backward (None: every partitioned one)
    block_fraction: float = 1.0  # share of the (non-expert) parameters in decoder blocks (FSDP2 reshards those)
    expert_fraction: float = 0.0  # share in routed experts split over ep (0 without ep; then tp_fraction has them)
    optim_floats: float = 2.0  # fp32 optimizer-state values per trainable parameter (Adam 2; Muon 1 on its matrices)
    muon_fraction: float = 0.0  # share of the trainable parameters optim=muon updates (gathered whole each step)


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


def elem_bytes(precision: str) -> int:
    """Bytes per element of the 16-bit working copy (4 in fp32)."""
    return 2 if precision in ("bf16", "fp16") else 4


def grad_elem_bytes(precision: str) -> int:
    """Bytes per gradient element on the wire: fp32 under bf16 too (backends/deepspeed_config.bf16_gradient_dtypes)."""
    return 4 if precision in ("bf16", "fp32") else 2


def state_bytes(role: RoleParams, layout: Layout, precision: str, grad_accum_steps: int = 1,
                on_gpu: bool = True) -> StateBytes:
    """One role's model states on one rank as the layout's backend holds them (its descriptor's `holdings`). A frozen
    role is trainable=0: weights only (compute dtype under DeepSpeed, fp32 under DDP/FSDP2), sharded at stage 3."""
    return layout.backend.holdings(role, layout, precision, grad_accum_steps, on_gpu)


def activation_bytes_per_layer(b: int, s: int, h: int, a: int, *, tp: int = 1, elem: int = 2,
                               scores: bool = True) -> float:
    """Korthikanti et al. 2022, bytes one block keeps for backward: s·b·h·(10 + 24/t) + 5·a·s²·b/t in 16-bit
    (34·s·b·h + 5·a·s²·b at t = 1), × elem/2. `scores=False` drops 5·a·s²·b (the QKᵀ scores, softmax and its
    dropout mask): sdpa / flash / flex attention never store the (b, a, s, s) tensors, only a (b, a, s) logsumexp,
    and recompute the scores in backward."""
    per = s * b * h * (10 + 24 / tp) + (5 * a * s * s * b / tp if scores else 0.0)
    return per * elem / 2


def eager_score_bytes(elem: int, softcapping: bool = False) -> int:
    """Bytes eager attention keeps per element of its (b, a, s, s) scores in one block, measured with saved-tensor
    hooks (transformers 5 eager_attention_forward): the softmax's output, in fp32 whatever the compute dtype (softmax
    saves it), and in 16-bit the copy cast back to the compute dtype that the scores @ V matmul saves (in fp32 the
    same tensor); attention-logit softcapping (Gemma-2) adds tanh's output in the compute dtype."""
    return 4 + (elem if elem < 4 else 0) + (elem if softcapping else 0)


def gated_activation_bytes_per_layer(b: int, s: int, h: int, a: int, *, intermediate: int, kv_heads: int,
                                     tp: int = 1, elem: int = 2, scores: bool = True,
                                     softcapping: bool = False, concat_outputs: bool = False) -> float:
    """A Llama-style block (RMSNorm, GQA, rotary, SwiGLU MLP, no dropout), counted from what autograd saves (measured
    with saved-tensor hooks, metrics/live.py): per token, two RMSNorms keep their input, the normalised and the
    weighted output (3h) and 1/rms (1) each — the input of the second is the attention residual, of the first the
    block input; attention keeps rotated q (h), k and v (2·kv, GQA unrepeated), its output (h, o_proj's input too)
    and a logsumexp per head (a); the MLP keeps gate, up, silu(gate) and their product (4i).
    → s·b·(6h + 2 + (2h + 2kv + 4i + a)/t) elements (TP splits the heads, so q, k, v, the attention output and
    the logsumexp, and the MLP; the norms and the replicated input of q/k/v stay whole: measured under pp 2 × tp 2,
    metrics/live.InFlightMeter, within −5 % .. +1 %), × elem bytes. GPT's 34·s·b·h (16-bit)
    assumes a 4h GELU MLP and dropout masks; for the tiny Llama (h 128, i 384) this count is 1.27× it, and matches
    the measured bytes to 0.01 %.

    `scores` (eager attention, the resolved attention of a family without sdpa such as Gemma-2): the (b, a, s, s)
    scores, b·a·s²·eager_score_bytes(elem, softcapping) bytes (t splits the heads); k and v are kept repeated to every
    head (repeat_kv copies them before the matmuls: 2·a·(h/a) for 2kv) and there is no logsumexp (a).

    `concat_outputs` (packed rows through per-sample attention: models/attention.py's sdpa_segments, the ring of
    ring_attention.py): each sample's attention output is kept by its kernel and their concatenation by o_proj, one
    more h/t per token (measured: 3,145 against 3,017 elements per token and layer for the tiny Llama)."""
    kv = (a if scores else kv_heads) * (h // a)
    attention_outputs = 2 if concat_outputs else 1
    per_token = 6 * h + 2 + ((1 + attention_outputs) * h + 2 * kv + 4 * intermediate + (0 if scores else a)) / tp
    kept = b * a * s * s * eager_score_bytes(elem, softcapping) / tp if scores else 0.0
    return s * b * per_token * elem + kept


def activation_bytes(b: int, s: int, h: int, a: int, layers: int, *, checkpointing: bool, tp: int = 1,
                     elem: int = 2, scores: bool = True, intermediate: int | None = None,
                     kv_heads: int | None = None, softcapping: bool = False, concat_outputs: bool = False) -> float:
    """All layers, plus the embedding output (2·s·b·h). Checkpointing keeps each block's input (2·s·b·h) and, in
    backward, one block's full activations at a time (its recompute). With `intermediate` (a gated, Llama-style
    block) the layer is `gated_activation_bytes_per_layer`, whose count holds the block input already, and the final
    RMSNorm adds its input, normalised and weighted output and 1/rms: s·b·(3h + 1)."""
    block_input = 2 * s * b * h * elem / 2
    if intermediate:
        layer = gated_activation_bytes_per_layer(b, s, h, a, intermediate=intermediate, kv_heads=kv_heads or a,
                                                 tp=tp, elem=elem, scores=scores, softcapping=softcapping,
                                                 concat_outputs=concat_outputs)
        outside = s * b * (3 * h + 1) * elem
        return (layers * block_input + layer if checkpointing else layers * layer) + outside
    layer = activation_bytes_per_layer(b, s, h, a, tp=tp, elem=elem, scores=scores)
    kept = layers * block_input + layer if checkpointing else layers * layer
    return kept + block_input


def logits_bytes(b: int, s: int, vocab: int) -> float:
    """The (b, s, V) logits in fp32 for the loss: b·s·V·4 (their gradient, as large, is not counted)."""
    return 4.0 * b * s * vocab


def fused_head_bytes(b: int, s: int, vocab: int, hidden: int, chunk: int, held_gradients: bool) -> tuple[float, float]:
    """The fused LM head and loss (models/fused_head.py) -> (held from forward to backward, peak). Held: the summed
    loss's gradients, computed in the forward: b·s·h·4 + V·h·4 (per-token outputs hold none: their backward recomputes
    each chunk). Peak: held + one chunk's fp32 logits, log-softmax and gradient, 3·min(c, b·s)·V·4."""
    held = 4.0 * (b * s * hidden + vocab * hidden) if held_gradients else 0.0
    return held, held + 12.0 * min(chunk, b * s) * vocab


@dataclass(frozen=True)
class Collective:
    what: str
    kind: str  # all_reduce | all_gather | reduce_scatter | reduce | all_to_all | p2p
    payload: float  # bytes of the full tensor handed to one call
    group: int  # ranks taking part
    times: int = 1  # calls per optimizer step
    overlapped: bool = True  # hidden behind compute (dp traffic); TP's all-reduces are on the critical path

    @property
    def wire(self) -> float:
        """Ring bytes each rank sends: (g-1)/g of the payload, twice for an all-reduce; a point-to-point send (p2p:
        pipeline stages) sends its payload once."""
        if self.group <= 1:
            return 0.0
        if self.kind == "p2p":
            return self.payload * self.times
        return (2 if self.kind == "all_reduce" else 1) * (self.group - 1) / self.group * self.payload * self.times


def muon_gathers(role: RoleParams, ranks: int) -> list[Collective]:
    """optim=muon's all-gather of one optimizer step: the fp32 update of every matrix it updates (`muon_fraction` of
    the trainable parameters), gathered whole from the `ranks` holding its pieces (ZeRO-1/2: the flat Muon group at
    once; ZeRO-3 and FSDP2: matrix by matrix, over dp × tp); every rank then runs Newton–Schulz on each whole matrix
    (compute is not split). DDP and ZeRO-0 hold them whole: none. The optimizer step waits on it: not overlapped."""
    if ranks <= 1 or not role.muon_fraction:
        return []
    return [Collective("Muon updates, whole matrices", "all_gather", 4 * role.trainable * role.muon_fraction, ranks,
                       overlapped=False)]


def communication(role: RoleParams, layout: Layout, precision: str, *, accum: int, tokens_per_micro: int,
                  hidden: int, layers: int, checkpointing: bool, on_gpu: bool = True) -> list[Collective]:
    """Collectives of one optimizer step for one role (trainable or frozen), from docs/formulas.md's table: the data-
    parallel ones as the layout's backend moves them (its descriptor's `collectives`), then tensor parallelism's."""
    t = role.trainable
    out = layout.backend.collectives(role, layout, precision, accum, on_gpu)
    if layout.tp > 1:  # Megatron: 2 all-reduces of the (b·s, h) activations forward, 2 backward, per block
        per_block = (4 if t else 2) + (2 if checkpointing and t else 0)  # recompute repeats the forward two
        out.append(Collective("TP activations", "all_reduce", elem_bytes(precision) * tokens_per_micro * hidden,
                              layout.tp, per_block * layers * accum, overlapped=False))
    return out


def step_seconds(hardware_flops: float, collectives: list[Collective], *, peak_flops: float, mfu: float,
                 link_bytes_per_s: float) -> dict[str, float]:
    """Compute at `mfu` of the peak; data-parallel traffic at the link bandwidth, overlapped with compute
    (DDP buckets, ZeRO/FSDP prefetch): step = max(compute, dp comm) + TP comm (on the critical path)."""
    compute = hardware_flops / (peak_flops * mfu)
    hidden = sum(c.wire for c in collectives if c.overlapped) / link_bytes_per_s
    exposed = sum(c.wire for c in collectives if not c.overlapped) / link_bytes_per_s
    return {"compute_s": compute, "comm_s": hidden + exposed, "step_s": max(compute, hidden) + exposed}
