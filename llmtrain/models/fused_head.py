"""The LM head and what the loss needs from it, computed together over chunks of tokens: no (tokens, V) logits.

The model still runs whole, through the wrapped module, so DDP's reducer, FSDP2's root forward, DeepSpeed ZeRO-3's
gather hooks and the live cost's hooks all see it. Only its output head changes: `install` swaps the head's class
for a subclass (the parameters, their names and their tying stay) whose forward, while a `HeadQuery` is open on it,
returns what the query asks for instead of the logits: per-token log p(target), entropy and argmax hits
((B, K, 3), fp32), or the summed loss. The model's `logits_to_keep` slices the hidden states before the head, so RL
keeps only its response positions. Outside a query (generation, export, a scalar head) the head is a plain Linear.

Two strategies (`ChunkedTokenLogps`, `ChunkedLossSum`), both exact against the unfused computation:
- per-token outputs (DPO, SimPO, ORPO, PPO, GRPO, eval) recompute each chunk's logits in backward: one more
  (n, h) x (h, V) matmul per chunk than the unfused path, but the upstream gradient of every token may differ;
- the summed loss (pretrain, SFT) computes each chunk's gradient during the forward (as Liger does) and only scales
  it in backward: no extra matmul, at the cost of holding the head's weight gradient from forward to backward.

A family's transform of the head's output runs inside the chunk: final-logit softcapping (Gemma 2/3) is switched off
in the config for the forward, so the model does not apply it to the query's result. The first query per head checks
that the model returned the head's output unchanged; a family transforming it another way stops with an error that
names model.fused_loss=off, never a wrong loss.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models import liger
from llmtrain.models.vocab_parallel import VocabShard, gathered_logits, local_head, owned_columns, sharded_chunk_values

SOFTCAP_FIELD = "final_logit_softcapping"  # Gemma 2/3: logits = c · tanh(logits / c)


def default_chunk_tokens(vocab: int, hidden: int) -> int:
    """Chunk rows so that one chunk's fp32 logits (c·V·4 bytes) are 32 KiB per hidden unit, and at least 128 MiB (a
    narrow model's chunks would otherwise be too short for an efficient matmul): Llama 3 8B 256 tokens, 128 MiB, as
    Liger's rule gives at 8k tokens per batch; a power of two in [64, 4096]."""
    rows = max(8 * 1024 * hidden, 2**25) / vocab
    return int(min(4096, max(64, 2 ** round(math.log2(max(rows, 1.0))))))


# A loss that is a sum over tokens, each token's term a function of that token's log p(target) and entropy alone:
# (rows: a slice of the B·K flattened positions, log p (n,), entropy (n,) or None) -> 0-d sum over those rows.
TokenLoss = Callable[[slice, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


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


# ---- the chunk maths (shared by both strategies) ----------------------------------------------------------------

@dataclass(frozen=True)
class ChunkSettings:
    chunk_tokens: int
    temperature: float
    softcap: float | None
    entropy: bool
    accuracy: bool
    shard: VocabShard | None = None  # the head's rows split over tp (models/vocab_parallel.py); None: all V here


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 s: ChunkSettings) -> torch.Tensor:
    """(n, h) -> (n, V) fp32: the head's logits (in the autocast dtype, as the model computes them), softcapped, / T."""
    z = F.linear(hidden, weight, bias).float()
    if s.softcap is not None:
        z = torch.tanh(z / s.softcap) * s.softcap
    return z / s.temperature if s.temperature != 1.0 else z


def chunk_values(z: torch.Tensor, targets: torch.Tensor, s: ChunkSettings):
    """z (n, V) fp32, targets (n,) -> (log p (n,), log-softmax (n, V), entropy (n,) or None, correct (n,) or None).
    The same operations as the unfused reference (log-softmax, then gather), so the two agree to rounding (bitwise
    where the CPU's vectorised kernels round a (chunk, V) tensor as they round the whole (N, V)).
    Vocab-sharded (s.shard): z holds this rank's V/tp columns, the values are over the whole vocabulary."""
    if s.shard is not None:
        return sharded_chunk_values(z, targets, s.shard, s.entropy, s.accuracy)
    valid = targets != IGNORE_INDEX
    log_probs = F.log_softmax(z, dim=-1)  # (n, V)
    picked = log_probs.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    logp = torch.where(valid, picked, torch.zeros_like(picked))
    entropy = -(log_probs.exp() * log_probs).sum(-1) if s.entropy else None
    correct = (z.argmax(-1) == targets) & valid if s.accuracy else None
    return logp, log_probs, entropy, correct


def chunk_grad_z(log_probs: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor,
                 grad_entropy: torch.Tensor | None, entropy: torch.Tensor | None,
                 shard: VocabShard | None = None) -> torch.Tensor:
    """d(Σ g_logp·log p + g_H·H)/dz, (n, V) fp32: (onehot − p)·g_logp on targets, −p·(log p + H)·g_H. Consumes
    `log_probs` (overwritten in place: a chunk's (n, V) buffers are the whole memory of the fused head).
    Vocab-sharded: log_probs (n, V/tp) are this rank's columns; the onehot lands only on the rank owning the target."""
    g = grad_logp * (targets != IGNORE_INDEX)  # (n,)
    cols, owned = (targets.clamp(min=0), None) if shard is None else owned_columns(targets, shard)
    if grad_entropy is None:
        grad = log_probs.exp_()  # p, in log_probs' buffer
    else:
        grad = log_probs.exp()  # p
        entropy_part = log_probs.add_(entropy.unsqueeze(1)).mul_(grad).mul_(grad_entropy.unsqueeze(1))  # p(log p+H)g_H
    grad.mul_(-g.unsqueeze(1))
    grad.scatter_add_(1, cols.unsqueeze(1), (g if owned is None else g * owned).unsqueeze(1))
    if grad_entropy is not None:
        grad.sub_(entropy_part)
    return grad


def accumulate_linear_grads(grad_z: torch.Tensor, z: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                            s: ChunkSettings, compute_dtype: torch.dtype, grad_hidden: torch.Tensor,
                            grad_weight: torch.Tensor, grad_bias: torch.Tensor | None) -> None:
    """Back through / T, the softcap and the linear (grad_z is consumed): writes the chunk's rows of grad_hidden
    (n, h) and adds to grad_weight (V, h) fp32 and grad_bias (V,) fp32, inside the matmul where the dtypes allow."""
    if s.temperature != 1.0:
        grad_z.div_(s.temperature)
    if s.softcap is not None:
        capped = z * s.temperature  # the softcapped logits
        grad_z.mul_(1 - (capped / s.softcap) ** 2)
    if grad_bias is not None:
        grad_bias += grad_z.sum(0)
    g = grad_z.to(compute_dtype)
    if g.dtype == weight.dtype == grad_hidden.dtype:
        torch.mm(g, weight, out=grad_hidden)
    else:
        grad_hidden.copy_(g @ weight.to(compute_dtype))
    if g.dtype == hidden.dtype == grad_weight.dtype:
        grad_weight.addmm_(g.t(), hidden)
    else:
        grad_weight += (g.t() @ hidden.to(compute_dtype)).float()


def chunks(n: int, size: int):
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def gradient_buffers(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """(grad hidden (N, h), grad weight (V, h) fp32, grad bias (V,) fp32 or None): the weight's and bias's gradients
    are summed over chunks in fp32 and take the parameter's dtype at the end."""
    return (torch.empty_like(hidden), torch.zeros(weight.shape, dtype=torch.float32, device=weight.device),
            None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device))


def write_values(out: torch.Tensor, rows: slice, logp: torch.Tensor, entropy: torch.Tensor | None,
                 correct: torch.Tensor | None) -> None:
    """A chunk's per-token values into the (N, 3) output: log p, entropy, argmax hits (0 where not asked)."""
    out[rows, 0] = logp
    if entropy is not None:
        out[rows, 1] = entropy
    if correct is not None:
        out[rows, 2] = correct.float()


class ChunkedTokenLogps(torch.autograd.Function):
    """hidden (N, h), weight (V, h), bias (V,) | None, targets (N,) -> (N, 3) fp32: log p(target), entropy, hits.
    Backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, s: ChunkSettings):
        out = torch.zeros(hidden.shape[0], 3, dtype=torch.float32, device=hidden.device)
        for rows in chunks(hidden.shape[0], s.chunk_tokens):
            z = chunk_logits(hidden[rows], weight, bias, s)
            logp, _, entropy, correct = chunk_values(z, targets[rows], s)
            write_values(out, rows, logp, entropy, correct)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.settings, ctx.autocast = s, autocast_state(hidden.device.type)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        s = ctx.settings
        grad_hidden, grad_weight, grad_bias = gradient_buffers(hidden, weight, bias)
        with restored_autocast(hidden.device.type, ctx.autocast):
            for rows in chunks(hidden.shape[0], s.chunk_tokens):
                z = chunk_logits(hidden[rows], weight, bias, s)
                _, log_probs, entropy, _ = chunk_values(z, targets[rows], s)
                grad_z = chunk_grad_z(log_probs, targets[rows], grad_out[rows, 0],
                                      grad_out[rows, 1] if s.entropy else None, entropy, s.shard)
                accumulate_linear_grads(grad_z, z, hidden[rows], weight, s, compute_dtype(hidden, weight),
                                        grad_hidden[rows], grad_weight, grad_bias)
        if s.shard is not None:  # each tp rank's columns' part of the sum over the vocabulary
            s.shard.all_reduce(grad_hidden)
        return (grad_hidden, grad_weight.to(weight.dtype), None if bias is None else grad_bias.to(bias.dtype),
                None, None)


class ChunkedTokenLoss(torch.autograd.Function):
    """hidden (N, h), weight, bias, targets (N,) -> (N, 3) fp32: log p(target) and entropy (values only), and in
    [0, 2] the token loss summed over every chunk, the one entry with a gradient. Each chunk's gradient is computed in
    the forward from the loss's gradient w.r.t. its tokens' log p and entropy, and scaled by the upstream gradient
    in backward: no logits are recomputed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, s: ChunkSettings, needs_grad: bool, token_loss: TokenLoss):
        out = torch.zeros(hidden.shape[0], 3, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden, grad_weight, grad_bias = gradient_buffers(hidden, weight, bias) if needs_grad else (None,) * 3
        for rows in chunks(hidden.shape[0], s.chunk_tokens):
            z = chunk_logits(hidden[rows], weight, bias, s)
            logp, log_probs, entropy, _ = chunk_values(z, targets[rows], s)
            write_values(out, rows, logp, entropy, None)
            leaves = [logp.requires_grad_(needs_grad), None if entropy is None else entropy.requires_grad_(needs_grad)]
            with torch.enable_grad():
                loss = token_loss(rows, *leaves)
            total += loss.detach().float()
            if needs_grad:
                wanted = [leaf for leaf in leaves if leaf is not None]
                grads = torch.autograd.grad(loss, wanted, allow_unused=True)
                grad_logp = grads[0] if grads[0] is not None else torch.zeros_like(logp)
                grad_entropy = grads[1] if entropy is not None else None
                grad_z = chunk_grad_z(log_probs, targets[rows], grad_logp.detach(),
                                      None if grad_entropy is None else grad_entropy.detach(),
                                      None if entropy is None else entropy.detach(), s.shard)
                accumulate_linear_grads(grad_z, z, hidden[rows], weight, s, compute_dtype(hidden, weight),
                                        grad_hidden[rows], grad_weight, grad_bias)
        if needs_grad and s.shard is not None:  # each tp rank's columns' part of the sum over the vocabulary
            s.shard.all_reduce(grad_hidden)
        out[0, 2] = total
        # saved (not kept on ctx) so that autograd, and the live cost's saved-tensor meter, see what is held
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight, grad_bias) if g is not None))
        ctx.has_bias = grad_bias is not None
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.saved_tensors:
            return None, None, None, None, None, None, None
        grad_hidden, grad_weight, *grad_bias = ctx.saved_tensors
        scale = grad_out[0, 2].float()  # log p and entropy are values only: their gradients are not followed
        grad_bias = (grad_bias[0] * scale).to(ctx.bias_dtype) if ctx.has_bias else None
        return (grad_hidden * scale.to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype), grad_bias,
                None, None, None, None)


def autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def restored_autocast(device_type: str, state: tuple[bool, torch.dtype]):
    enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype) if enabled else contextlib.nullcontext()


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul ran in: the autocast dtype when on, else the weight's."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


# ---- the head ----------------------------------------------------------------------------------------------------

class FusedHeadMixin:
    """Mixed into the head's class by `install`; `query` is set only while a HeadQuery is open."""
    query: HeadQuery | None = None
    chunk_tokens: int = 0  # 0: default_chunk_tokens(V, h)
    softcap: float | None = None
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
    return True


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

    def read(self, logits: torch.Tensor) -> HeadAnswer:
        """logits: the model's output `.logits`: (B, K, V) unfused, or what the fused head returned."""
        if self.head is None:
            return unfused_answer(logits, self.query)
        self.check_returned(logits)
        logps, entropy, third = logits.unbind(-1)  # each (B, K)
        if self.query.token_loss is not None:  # third: the loss at [0, 0], the only entry with a gradient
            return HeadAnswer(logps=logps.detach(), entropy=entropy.detach() if self.query.entropy else None,
                              loss_sum=third[0, 0])
        return HeadAnswer(logps=logps, entropy=entropy if self.query.entropy else None,
                          correct=third.bool() if self.query.accuracy else None)

    def check_returned(self, logits: torch.Tensor) -> None:
        """The first fused forward of a head: the model must hand back what the head returned."""
        if self.head.verified:
            return
        if not self.returned or self.returned[-1].shape != logits.shape or not torch.equal(self.returned[-1], logits):
            raise RuntimeError("model.fused_loss: this model transforms its LM head's output in a way the fused "
                               "head-and-loss path does not know (it applies final_logit_softcapping only); set "
                               "model.fused_loss=off")
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
    hook = None if head.verified else head.register_forward_hook(lambda m, args, out: ask.returned.append(out))
    head.query = query
    if softcap is not None:
        setattr(config, SOFTCAP_FIELD, None)
    try:
        yield ask
    finally:
        head.query = None
        if softcap is not None:
            setattr(config, SOFTCAP_FIELD, softcap)
        if hook is not None:
            hook.remove()


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels aligned with the tokens -> (B, T) targets: position t predicts label t + 1 (the last: none)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def action_targets(sequences: torch.Tensor, num_actions: int) -> torch.Tensor:
    """(B, T) rollout rows whose last A tokens are actions -> (B, A + 1) targets of the last A + 1 positions."""
    return F.pad(sequences[:, -num_actions:], (0, 1), value=IGNORE_INDEX)
