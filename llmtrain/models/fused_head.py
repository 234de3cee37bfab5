"""The LM head and what the loss needs from it, computed together over chunks of tokens: no (tokens, V) logits.

The model still runs whole, through the wrapped module, so DDP's reducer, FSDP2's root forward, DeepSpeed ZeRO-3's
gather hooks and the live cost's hooks all see it. Only its output head changes: `install` swaps the head's class
for a subclass (the parameters, their names and their tying stay) whose forward, while a `HeadQuery` is open on it,
returns what the query asks for instead of the logits: per-token log p(target), entropy and argmax hits
((B, K, 3), fp32), or the summed loss. The model's `logits_to_keep` slices the hidden states before the head, so RL
keeps only its response positions. Outside a query (generation, export, a scalar head) the head is a plain Linear.

Two strategies (chunked_head.py: `ChunkedTokenLogps`, `ChunkedTokenLoss`), both exact against the unfused path:
- per-token outputs (DPO, SimPO, ORPO, PPO, GRPO, eval) recompute each chunk's logits in backward: one more
  (n, h) x (h, V) matmul per chunk than the unfused path, but the upstream gradient of every token may differ;
- the summed loss (pretrain, SFT) computes each chunk's gradient during the forward (as Liger does) and only scales
  it in backward: no extra matmul, at the cost of holding the head's weight gradient from forward to backward.

A family's transform of the head's output runs inside the chunk: final-logit softcapping (Gemma 2/3) is switched off
in the config for the forward, so the model does not apply it to the query's result. A scale of the logits (Cohere's
× logit_scale, Granite's / logits_scaling) goes onto the hidden states (and bias) before the head, and the model's
field is set to 1 for the forward; on the first query it is set to multiply by 2 instead, which proves the model reads
it (the answer is halved back, exactly). The first query per head checks that the model returned the head's output
unchanged (or doubled so); a family transforming it another way stops with an error that names
model.fused_loss=off, never a wrong loss.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models import liger
from llmtrain.models.chunked_head import ChunkedTokenLogps, ChunkedTokenLoss, ChunkSettings, TokenLoss, compute_dtype
from llmtrain.models.vocab_parallel import VocabShard, gathered_logits, local_head

SOFTCAP_FIELD = "final_logit_softcapping"  # Gemma 2/3: logits = c · tanh(logits / c)
# field -> the power of its value that multiplies the logits after the head: Cohere's logits × logit_scale (read from
# the causal LM's own copy), Granite's logits / logits_scaling (read from the config)
SCALE_FIELDS = {"logit_scale": 1, "logits_scaling": -1}
PROBE = 2.0  # what the scale fields make the model multiply by on a head's first query (exact in every float format)


def head_is_fused(fused_loss: str, vocab: int, hidden: int) -> bool:
    """model.fused_loss -> whether the LM head and loss run fused. `auto` fuses where the full logits' peak, 12·V bytes
    a token (fp32 logits, their log-softmax and its gradient), outweighs two decoder layers' activations, 2 × 34·h
    (Korthikanti's 16-bit count without the attention scores): V > 5.7·h. Llama 2 and 3, Mistral, Qwen and Gemma fuse;
    a small vocabulary (the tiny recipes' 263 at h 128) keeps full logits, which cost nothing there and run faster than
    the chunked path's extra kernels (benchmarks/vocab.py shows both ends)."""
    if fused_loss == "auto":
        return 12 * vocab > 2 * 34 * hidden
    return fused_loss != "off"


def default_chunk_tokens(vocab: int, hidden: int) -> int:
    """Chunk rows so that one chunk's fp32 logits (c·V·4 bytes) are 32 KiB per hidden unit, and at least 128 MiB (a
    narrow model's chunks would otherwise be too short for an efficient matmul): Llama 3 8B 256 tokens, 128 MiB, as
    Liger's rule gives at 8k tokens per batch; a power of two in [64, 4096]."""
    rows = max(8 * 1024 * hidden, 2**25) / vocab
    return int(min(4096, max(64, 2 ** round(math.log2(max(rows, 1.0))))))


def negative_log_likelihood(rows: slice, logp: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
    """Pretrain/SFT: −Σ log p over the targets (log p is 0 at ignored positions)."""
    return -logp.sum()


@dataclass(frozen=True)
class HeadQuery:
    """What a stage asks of the LM head for one forward. targets: (B, K), the token each of the last K positions
    predicts (IGNORE_INDEX where none); K = T keeps every position. token_loss: a loss summed over tokens, which the
    fused head computes with its gradient chunk by chunk in the forward (no logits recomputed in backward); then the
    answer's log-probs and entropy are values only (detached)."""
    targets: torch.Tensor
    temperature: float = 1.0
    entropy: bool = False
    accuracy: bool = False
    token_loss: TokenLoss | None = None
    # (K,) long: the positions whose hidden states reach the head (a packed row's action states, transformers'
    # logits_to_keep as indices; repeats allowed); None: the last K
    positions: torch.Tensor | None = None


@dataclass
class HeadAnswer:
    """With a token_loss, logps and entropy are values only; under Liger (liger_computes) they are zeros: Liger
    returns the summed loss alone, and the causal-LM stage reads nothing else from its training query."""
    logps: torch.Tensor | None = None  # (B, K) fp32 log p(target), 0 where ignored
    entropy: torch.Tensor | None = None  # (B, K) fp32 entropy of softmax(logits / T)
    correct: torch.Tensor | None = None  # (B, K) bool argmax == target, on targets
    loss_sum: torch.Tensor | None = None  # 0-d fp32: the query's token_loss, with its gradient


# ---- the head ----------------------------------------------------------------------------------------------------

class FusedHeadMixin:
    """Mixed into the head's class by `install`; `query` is set only while a HeadQuery is open."""
    query: HeadQuery | None = None
    chunk_tokens: int = 0  # 0: default_chunk_tokens(V, h)
    softcap: float | None = None
    logit_multiplier: float = 1.0  # the family's scale of the logits, applied here (SCALE_FIELDS)
    kernel: str = "chunked"  # the summed loss's: "liger" where liger_computes(query), else chunked (models/liger.py)
    verified: bool = False  # the model returned this head's output unchanged once

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden (B, K, h)
        query = self.query
        weight, bias, shard = local_head(self)  # this tp rank's rows when the head is vocab-sharded
        if query is None:
            return super().forward(hidden) if shard is None else gathered_logits(F.linear(hidden, weight, bias), shard)
        if hidden.shape[:2] != query.targets.shape:
            raise RuntimeError(f"fused LM head: hidden states {tuple(hidden.shape[:2])} do not match the query's "
                               f"targets {tuple(query.targets.shape)}")
        settings = ChunkSettings(self.chunk_tokens or default_chunk_tokens(self.out_features, self.in_features),
                                 query.temperature, self.softcap, query.entropy, query.accuracy, shard)
        flat, targets = hidden.flatten(0, 1), query.targets.flatten()
        if self.logit_multiplier != 1.0:  # s·(h Wᵀ + b) = (s·h) Wᵀ + s·b
            flat, bias = flat * self.logit_multiplier, None if bias is None else bias * self.logit_multiplier
        if self.kernel == "liger" and liger_computes(query, shard):
            out = liger.liger_loss_rows(flat, weight, bias, targets, self.softcap, compute_dtype(flat, weight))
        elif query.token_loss is not None:
            needs_grad = torch.is_grad_enabled() and (flat.requires_grad or self.weight.requires_grad)
            out = ChunkedTokenLoss.apply(flat, weight, bias, targets, settings, needs_grad, query.token_loss)
        else:
            out = ChunkedTokenLogps.apply(flat, weight, bias, targets, settings)
        return out.view(*hidden.shape[:2], 3)


def liger_computes(query: HeadQuery, shard: VocabShard | None) -> bool:
    """What Liger's kernel computes (models/liger.py): the causal-LM sum at temperature 1 without entropy, on a head
    holding the whole vocabulary."""
    return (query.token_loss is negative_log_likelihood and query.temperature == 1.0 and not query.entropy
            and shard is None)


_FUSED_CLASSES: dict[type, type] = {}


def install(model: torch.nn.Module, chunk_tokens: int = 0, kernel: str = "chunked") -> bool:
    """Give a causal LM's output head the fused forward (in place). False when its head is not a plain Linear
    (then the caller keeps the unfused path). kernel "liger": the causal-LM sum through Liger (models/liger.py)."""
    head = model.get_output_embeddings()
    if isinstance(head, FusedHeadMixin):
        return True
    if type(head) is not torch.nn.Linear:
        return False
    base = type(head)
    if base not in _FUSED_CLASSES:
        _FUSED_CLASSES[base] = type(f"Fused{base.__name__}", (FusedHeadMixin, base), {})
    head.__class__ = _FUSED_CLASSES[base]
    head.chunk_tokens, head.kernel = chunk_tokens, kernel
    head.softcap = getattr(model.config, SOFTCAP_FIELD, None)
    head.family_config = model.config  # the model reads its softcap from here at forward time
    head.scale_fields = scale_fields(model)  # a list, so the model is not registered as the head's submodule
    head.logit_multiplier = logit_multiplier(head.scale_fields)
    return True


def scale_fields(model: torch.nn.Module) -> list[tuple[object, str, float]]:
    """(holder, field, value) of each SCALE_FIELDS number on the causal LM or its config."""
    return [(holder, field, float(getattr(holder, field))) for field in SCALE_FIELDS for holder in (model, model.config)
            if type(getattr(holder, field, None)) in (int, float)]


def logit_multiplier(fields: list[tuple[object, str, float]]) -> float:
    """What the family multiplies its logits by; the model's and its config's copies of a field must agree."""
    values: dict[str, set[float]] = {}
    for _, field, value in fields:
        values.setdefault(field, set()).add(value)
    if any(len(copies) > 1 for copies in values.values()):
        raise ValueError(f"model.fused_loss: the model and its config disagree on {sorted(values)} "
                         f"({values}); set them equal, or set model.fused_loss=off")
    return math.prod(value ** SCALE_FIELDS[field] for field, (value,) in values.items())


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fused_head_of(module: torch.nn.Module) -> FusedHeadMixin | None:
    """The fused head inside a (wrapped: DDP, DeepSpeed, FSDP2, peft) causal LM; None when it has none."""
    if module not in _HEADS:
        _HEADS[module] = next((m for m in module.modules() if isinstance(m, FusedHeadMixin)), None)
    return _HEADS[module]


class Asking:
    """An open query: `kwargs` go to the module's forward (the K positions to keep); `read(out.logits)` answers."""

    def __init__(self, module: torch.nn.Module, query: HeadQuery):
        self.query, self.head = query, fused_head_of(module)
        keep = query.targets.shape[1] if query.positions is None else query.positions
        self.kwargs = {"logits_to_keep": keep}
        self.returned: list[torch.Tensor] = []  # what the head returned, recorded until the head is verified
        # the model multiplies the head's output by PROBE on a scaled head's first query (`asking`)
        self.factor = PROBE if self.head is not None and self.head.logit_multiplier != 1.0 and not self.head.verified \
            else 1.0

    def read(self, logits: torch.Tensor) -> HeadAnswer:
        """logits: the model's output `.logits`: (B, K, V) unfused, or what the fused head returned."""
        if self.head is None:
            return unfused_answer(logits, self.query)
        self.check_returned(logits)
        logps, entropy, third = (logits / self.factor if self.factor != 1.0 else logits).unbind(-1)  # each (B, K)
        if self.query.token_loss is not None:  # third: the loss at [0, 0], the only entry with a gradient
            return HeadAnswer(logps=logps.detach(), entropy=entropy.detach() if self.query.entropy else None,
                              loss_sum=third[0, 0])
        return HeadAnswer(logps=logps, entropy=entropy if self.query.entropy else None,
                          correct=third.bool() if self.query.accuracy else None)

    def check_returned(self, logits: torch.Tensor) -> None:
        """The first fused forward of a head: the model must hand back what the head returned."""
        if self.head.verified:
            return
        returned = self.returned[-1] if self.returned else None
        if returned is not None and self.factor != 1.0:
            returned = returned * self.factor
        if returned is None or returned.shape != logits.shape or not torch.equal(returned, logits):
            raise RuntimeError("model.fused_loss: this model transforms its LM head's output in a way the fused "
                               f"head-and-loss path does not know (it knows {SOFTCAP_FIELD} and the scales "
                               f"{', '.join(SCALE_FIELDS)}); set model.fused_loss=off")
        self.head.verified = True


def unfused_answer(logits: torch.Tensor, q: HeadQuery) -> HeadAnswer:
    """The reference: the same quantities from the model's full logits (B, K, V) (model.fused_loss=off)."""
    scaled = logits.float()
    if q.temperature != 1.0:
        scaled = scaled / q.temperature
    logps = -F.cross_entropy(scaled.flatten(0, 1), q.targets.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none").view_as(q.targets)  # (B, K), 0 where ignored
    entropy = None
    if q.entropy:
        logp_all = F.log_softmax(scaled, dim=-1)  # (B, K, V)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    correct = (logits.argmax(-1) == q.targets) & (q.targets != IGNORE_INDEX) if q.accuracy else None
    if q.token_loss is not None:
        every = slice(0, logps.numel())
        loss = q.token_loss(every, logps.flatten(), None if entropy is None else entropy.flatten())
        return HeadAnswer(logps=logps.detach(), entropy=None if entropy is None else entropy.detach(), loss_sum=loss)
    return HeadAnswer(logps=logps, entropy=entropy, correct=correct)


@contextlib.contextmanager
def asking(module: torch.nn.Module, query: HeadQuery):
    """Open `query` on the module's head for one forward:
    `with asking(m, q) as ask: out = m(**inputs, **ask.kwargs)`, then `ask.read(out.logits)`."""
    ask = Asking(module, query)
    head = ask.head
    if head is None:
        yield ask
        return
    config, softcap = head.family_config, head.softcap
    scales = head.scale_fields if head.logit_multiplier != 1.0 else []
    hook = None if head.verified else head.register_forward_hook(lambda m, args, out: ask.returned.append(out))
    head.query = query
    if softcap is not None:
        setattr(config, SOFTCAP_FIELD, None)
    for holder, field, _ in scales:
        setattr(holder, field, ask.factor ** SCALE_FIELDS[field])
    try:
        yield ask
    finally:
        head.query = None
        if softcap is not None:
            setattr(config, SOFTCAP_FIELD, softcap)
        for holder, field, value in scales:
            setattr(holder, field, value)
        if hook is not None:
            hook.remove()


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels aligned with the tokens -> (B, T) targets: position t predicts label t + 1 (the last: none)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def action_targets(sequences: torch.Tensor, num_actions: int) -> torch.Tensor:
    """(B, T) rollout rows whose last A tokens are actions -> (B, A + 1) targets of the last A + 1 positions."""
    return F.pad(sequences[:, -num_actions:], (0, 1), value=IGNORE_INDEX)
