"""The fused head's chunk maths: the two autograd functions (per-token log-probs, logits recomputed in backward; the
summed loss, its gradient computed in the forward) and what they share: one chunk's logits, its log p(target),
entropy and argmax hits, its gradient w.r.t. the logits, the head's weight gradient accumulated over chunks.
fused_head.py decides when they run; models/vocab_parallel.py supplies the vocab-sharded variants under tp."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.vocab_parallel import VocabShard, owned_columns, sharded_chunk_values

# A loss that is a sum over tokens, each token's term a function of that token's log p(target) and entropy alone:
# (rows: a slice of the B·K flattened positions, log p (n,), entropy (n,) or None) -> 0-d sum over those rows.
TokenLoss = Callable[[slice, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


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
