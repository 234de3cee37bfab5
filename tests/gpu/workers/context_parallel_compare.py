"""Run by tests/gpu/test_context_parallel.py under `torchrun --nproc_per_node 2` (NCCL):
`python -m tests.gpu.workers.context_parallel_compare OUT_DIR [DEVICE]`.

Both cp implementations' registered attention functions (models/torch_context_parallel.register_cp_attention: "ring",
llmtrain's; "torch", torch's context parallelism) on each rank's zig-zag shard of the same rows: their outputs and
q/k/v gradients against causal sdpa over the whole rows (fp32, GQA), then forward + backward timed in bf16 on long
rows (the slower rank's mean, CUDA events). Writes OUT_DIR/rank_<r>.json. DEVICE cpu (gloo) runs the ring only: a
check of this worker itself where no GPU is (torch's ring has no CPU kernel)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from llmtrain.data.sequence_shard import shard_positions
from llmtrain.models.torch_context_parallel import register_cp_attention

EXACT = dict(batch=2, heads=4, kv_heads=2, width=64, head_dim=16)  # fp32, against whole-row sdpa
TIMED = dict(batch=1, heads=16, kv_heads=4, width=32768, head_dim=128)  # bf16, per row: 16k tokens per rank
WARMUP, REPEATS = 3, 10


def _rows(batch, heads, kv_heads, width, head_dim, dtype, device, seed=0):
    """q (B, H, T, D), k/v (B, KV, T, D) of whole rows, the same on every rank (seeded), and dout (B, H, T, D)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, n, width, head_dim, generator=g).to(device, dtype)
                     for n in (heads, kv_heads, kv_heads, heads))
    return q, k, v, dout


def _local(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x[:, :, index].detach().clone().requires_grad_()


def _run(name: str, q, k, v, dout):
    """One forward + backward of the registered attention on this rank's shard -> (out (B, H, L, D), grads)."""
    module = SimpleNamespace(scaling=q.shape[-1] ** -0.5)
    out = ALL_ATTENTION_FUNCTIONS[name](module, q, k, v, None, scaling=module.scaling)[0].transpose(1, 2)
    return out, torch.autograd.grad(out, (q, k, v), dout)


def exactness(name: str, rank: int, cp: int, device) -> dict:
    """Max abs errors of out, dq, dk, dv against causal sdpa over the whole rows (fp32)."""
    q, k, v, dout = _rows(**EXACT, dtype=torch.float32, device=device)
    whole = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    groups = EXACT["heads"] // EXACT["kv_heads"]
    ref = F.scaled_dot_product_attention(whole[0], whole[1].repeat_interleave(groups, 1),
                                         whole[2].repeat_interleave(groups, 1), is_causal=True)
    ref_grads = torch.autograd.grad(ref, whole, dout)
    index = shard_positions(EXACT["width"], rank, cp, cp).to(device)  # (T/cp,) this rank's zig-zag chunks
    out, grads = _run(name, *(_local(x, index) for x in (q, k, v)), dout[:, :, index])
    errors = [(out.detach() - ref.detach()[:, :, index]).abs().max()]
    errors += [(g - r[:, :, index]).abs().max() for g, r in zip(grads, ref_grads)]
    return dict(zip(("out", "dq", "dk", "dv"), (float(e) for e in errors)))


def timing(name: str, rank: int, cp: int, device) -> float:
    """Mean ms of one bf16 forward + backward on this rank's shard of TIMED rows, the slower rank's."""
    q, k, v, dout = _rows(**TIMED, dtype=torch.bfloat16, device=device, seed=1)
    index = shard_positions(TIMED["width"], rank, cp, cp).to(device)
    local, dout = [_local(x, index) for x in (q, k, v)], dout[:, :, index].contiguous()
    for _ in range(WARMUP):
        _run(name, *local, dout)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(REPEATS):
        _run(name, *local, dout)
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor(start.elapsed_time(end) / REPEATS, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def main(out_dir: Path, device_type: str) -> int:
    cuda = device_type == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device_type, (cp,), mesh_dim_names=("cp",))
    report = {"rank": rank, "cp": cp, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    try:
        for implementation in ("ring", "torch") if cuda else ("ring",):
            name = register_cp_attention(implementation, cp, mesh)
            report[implementation] = {"errors": exactness(name, rank, cp, device)}
            if cuda:
                report[implementation]["fwd_bwd_ms"] = timing(name, rank, cp, device)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"rank_{rank}.json").write_text(json.dumps(report, indent=2))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cuda"))
