"""Run under torchrun by tests/dist/test_lora.py (test_fsdp2_resume_restores_every_ranks_adapter_shard):
`torchrun --nproc_per_node 2 -m tests.dist.workers.lora_adapter_shards MODEL_DIR OUT_DIR`. A LoRA model on FSDP2
trains 2 steps, saves a DCP checkpoint, zeroes its adapter shards and Adam moments, loads the checkpoint back, and
saves this rank's local adapter shards and Adam first moments as trained, as zeroed and as loaded back
(OUT_DIR/rank_<r>.pt), for the test to compare."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in tensors.items()}


def zeroed_adapter_worker(model_dir: Path, out_dir: Path) -> None:
    from torch.distributed.tensor import DTensor

    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.backends.fsdp2 import FSDP2Backend
    from llmtrain.distributed import init_distributed, shutdown
    from llmtrain.losses.lm import lm_loss_sum
    from llmtrain.models.load import build_model, load_tokenizer
    from llmtrain.models.lora import LoraSettings

    ctx = init_distributed("cpu", 300)
    backend = FSDP2Backend(ctx, "fp32", {})
    with backend.model_init_context():
        model = build_model(name_or_path=str(model_dir), from_config=None, config_path=None,
                            tokenizer=load_tokenizer(str(model_dir), False), attn_implementation="sdpa", dropout=0.0,
                            activation_checkpointing=False, trust_remote_code=False, seed=0,
                            lora=LoraSettings(4, 8.0, 0.0, "all-linear", None))
    spec = OptimizerSpec(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                         min_lr_ratio=1.0, max_grad_norm=0.0, max_steps=10)
    engine = backend.wrap(model, spec)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(ctx.rank))  # (B, T)
    for _ in range(2):  # B moves away from 0
        engine.backward(lm_loss_sum(engine.module(input_ids=ids).logits, ids) / ids.numel())
        engine.clip_or_fused_step()
        engine.step()
    adapters = {n: p for n, p in engine.model.named_parameters() if "lora_" in n}
    local = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in adapters.items()}
    moment = {n: engine.optimizer.state[p]["exp_avg"] for n, p in adapters.items()}
    local_moment = {n: m.to_local() if isinstance(m, DTensor) else m for n, m in moment.items()}
    evidence = {"global_numel": {n: p.numel() for n, p in adapters.items()}}
    evidence["trained"], evidence["trained_exp_avg"] = snapshot(local), snapshot(local_moment)
    engine.save_checkpoint(out_dir / "ckpt")
    with torch.no_grad():
        for t in [*local.values(), *local_moment.values()]:
            t.zero_()
    evidence["zeroed"], evidence["zeroed_exp_avg"] = snapshot(local), snapshot(local_moment)
    engine.load_checkpoint(out_dir / "ckpt")
    params = {n: p for n, p in engine.model.named_parameters() if "lora_" in n}
    evidence["loaded"] = snapshot({n: p.to_local() if isinstance(p, DTensor) else p for n, p in params.items()})
    moment = {n: engine.optimizer.state[p]["exp_avg"] for n, p in params.items()}
    evidence["loaded_exp_avg"] = snapshot({n: m.to_local() if isinstance(m, DTensor) else m for n, m in moment.items()})
    torch.save(evidence, out_dir / f"rank_{ctx.rank}.pt")  # the test compares these itself
    shutdown()


if __name__ == "__main__":
    zeroed_adapter_worker(Path(sys.argv[1]), Path(sys.argv[2]))
