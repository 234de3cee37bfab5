"""The vocab-sharded fused head (models/vocab_parallel.py): the rows each tp rank holds, and two real gloo ranks
(spawned processes, no torchrun) each holding part of an odd vocabulary, whose chunked log p, entropy, argmax hits,
summed loss and gradients (hidden states and each rank's weight and bias rows) equal the autograd computation on the
full logits in one process; the plain forward's gathered logits equal the whole Linear's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.vocab_parallel import shard_rows
from tests.helpers import spawn_ranks

V, H, N = 13, 6, 10  # odd V: the ranks hold 7 and 6 rows
TEMPERATURE, SOFTCAP, CHUNK = 0.7, 5.0, 4  # CHUNK does not divide N: a short last chunk


@pytest.mark.parametrize("vocab,tp,expected", [
    (263, 2, [(0, 132), (132, 131)]),  # the tests' tiny tokenizer
    (128256, 8, [(r * 16032, 16032) for r in range(8)]),  # Llama 3
    (5, 4, [(0, 2), (2, 2), (4, 1), (5, 0)]),  # torch.chunk leaves the last rank empty
])
def test_shard_rows_cut_as_torch_chunk(vocab, tp, expected):
    assert [shard_rows(vocab, tp, rank) for rank in range(tp)] == expected
    assert [len(c) for c in torch.arange(vocab).chunk(tp)] + [0] * (tp - len(torch.arange(vocab).chunk(tp))) == \
        [rows for _, rows in expected]


def _inputs():
    torch.manual_seed(0)
    hidden = torch.randn(N, H)
    weight, bias = torch.randn(V, H), torch.randn(V)
    targets = torch.tensor([0, 12, 6, 7, IGNORE_INDEX, 3, 9, IGNORE_INDEX, 11, 6])  # both halves, -100 twice
    weight[2], bias[2] = weight[9], bias[9]  # equal rows on the two ranks: a tie, the first index wins
    best = F.linear(hidden, weight, bias).argmax(-1)  # (N,)
    targets[[1, 5, 8]] = best[[1, 5, 8]]  # argmax hits at three positions
    return hidden, weight, bias, targets


def _reference(hidden, weight, bias, targets):
    """The full logits in one process, plain autograd: (log p, entropy, hits, grads of Σ log p·c + H·d)."""
    hidden, weight, bias = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    z = torch.tanh(F.linear(hidden, weight, bias) / SOFTCAP) * SOFTCAP / TEMPERATURE  # (N, V)
    log_probs = F.log_softmax(z, -1)
    valid = targets != IGNORE_INDEX
    logp = torch.where(valid, log_probs.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    hits = (z.argmax(-1) == targets) & valid
    c, d = torch.linspace(0.5, 1.5, N), torch.linspace(-1, 1, N)
    ((logp * c).sum() + (entropy * d).sum()).backward()
    return logp.detach(), entropy.detach(), hits, hidden.grad, weight.grad, bias.grad, c, d


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from llmtrain.models.chunked_head import ChunkedTokenLogps, ChunkedTokenLoss, ChunkSettings
    from llmtrain.models.vocab_parallel import VocabShard, gathered_logits

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    hidden, weight, bias, targets = _inputs()
    ref_logp, ref_entropy, ref_hits, ref_gh, ref_gw, ref_gb, c, d = _reference(hidden, weight, bias, targets)
    start, rows = shard_rows(V, 2, rank)
    shard = VocabShard(start, rows, V, mesh, mesh.get_group())
    settings = ChunkSettings(CHUNK, TEMPERATURE, SOFTCAP, entropy=True, accuracy=True, shard=shard)

    def local_leaves():
        return (hidden.clone().requires_grad_(), weight[start:start + rows].clone().requires_grad_(),
                bias[start:start + rows].clone().requires_grad_())

    h, w, b = local_leaves()
    out = ChunkedTokenLogps.apply(h, w, b, targets, settings)  # (N, 3)
    ((out[:, 0] * c).sum() + (out[:, 1] * d).sum()).backward()
    rel = {"logps": _rel(out[:, 0], ref_logp), "entropy": _rel(out[:, 1], ref_entropy),
           "hits_equal": bool(torch.equal(out[:, 2].bool(), ref_hits)), "hits": int(ref_hits.sum()),
           "grad_hidden": _rel(h.grad, ref_gh), "grad_weight": _rel(w.grad, ref_gw[start:start + rows]),
           "grad_bias": _rel(b.grad, ref_gb[start:start + rows])}

    def token_loss(chunk_rows, logp, entropy):  # the same sum, computed with its gradient in the forward
        return (logp * c[chunk_rows]).sum() + (entropy * d[chunk_rows]).sum()

    h, w, b = local_leaves()
    out = ChunkedTokenLoss.apply(h, w, b, targets, settings, True, token_loss)
    out[0, 2].backward()
    rel.update(loss_sum=_rel(out[0, 2], (ref_logp * c).sum() + (ref_entropy * d).sum()),
               loss_grad_hidden=_rel(h.grad, ref_gh), loss_grad_weight=_rel(w.grad, ref_gw[start:start + rows]))

    h, w, b = local_leaves()
    whole = gathered_logits(F.linear(h, w, b), shard)  # (N, V)
    (whole * torch.arange(V)).sum().backward()
    rel.update(gathered=_rel(whole, F.linear(hidden, weight, bias)),
               gathered_grad_weight=_rel(w.grad, (torch.arange(V)[:, None] * hidden.sum(0))[start:start + rows]))
    results.put((rank, rel))
    dist.destroy_process_group()


def _rel(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.detach() - reference).abs().max() / reference.abs().max().clamp(min=1e-12)).item()


def test_two_ranks_equal_the_full_logits():
    received, exit_codes = spawn_ranks(_rank, messages=2)
    reports = dict(received)
    assert exit_codes == [0, 0]
    for rank, report in reports.items():
        assert report.pop("hits_equal") and report.pop("hits") >= 3, (rank, report)
        assert all(value <= 1e-6 for value in report.values()), (rank, report)
