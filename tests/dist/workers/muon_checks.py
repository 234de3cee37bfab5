"""optim=muon on every backend against one-process torch.optim.Muon (+ AdamW for the rest), run inside the 2-rank
launch of tests/dist/workers/fsdp2_checks.py (`worker`): no launch of its own.

Every rank trains on the same batch, so each backend's averaged gradient is the one-process gradient bit for bit
(x/2 + x/2 = x in fp32) and any difference in the weights is the optimizer's: the gather of each matrix, the shard
kept, ZeRO's flat offsets. Under tp (row-parallel matmuls) and ZeRO-3 (its own Linear backward) gradients differ
from one process in the last bits, and torch's Newton-Schulz, which runs in bf16, turns that into ~1e-4 weight
differences in one step: there (INJECTED) the one-process gradient is put in place of the engine's before the
optimizer steps, so the optimizer alone is compared.
Returns {backend: max |weight - torch's weight|} after STEPS steps, on rank 0.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

STEPS = 3
MUON = dict(lr=2e-2, weight_decay=0.05, momentum=0.9, nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315),
            eps=1e-7, ns_steps=5)
# name -> (backend, options); every run 2 ranks, fp32, no clipping (a norm summed in another order would differ)
CASES = {"ddp": ("ddp", {}), "fsdp2": ("fsdp2", {}), "fsdp2_tp": ("fsdp2", {"tp": 2}),
         **{f"zero{s}": ("deepspeed", {"zero_stage": s}) for s in (1, 2, 3)}}
INJECTED = ("fsdp2_tp", "zero3")  # gradients not bitwise one-process ones: the reference's put in their place


def spec():
    from llmtrain.backends.base import OptimizerSpec
    from llmtrain.optim.spec import MuonSpec

    muon = MuonSpec(**MUON, adjust_lr_fn="match_rms_adamw")
    return OptimizerSpec(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, schedule="constant",
                         min_lr_ratio=1.0, max_grad_norm=0.0, max_steps=STEPS, muon=muon)


def batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (2, 16), generator=generator) for _ in range(STEPS)]  # (B, T), every rank's


def torch_optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch alone: Muon (match_rms_adamw) on the hidden matrices, AdamW (decay on matrices) on the rest."""
    io = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    hidden = [p for p in model.parameters() if p.ndim == 2 and id(p) not in io]
    rest = [p for p in model.parameters() if not (p.ndim == 2 and id(p) not in io)]
    s = spec()
    return [torch.optim.Muon(hidden, **MUON, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": s.weight_decay},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=s.lr, betas=s.betas, eps=s.eps)]


def mean_loss(module, ids: torch.Tensor) -> torch.Tensor:
    from llmtrain.losses.lm import lm_loss_sum

    return lm_loss_sum(module(input_ids=ids).logits, ids) / ids.numel()


def torch_reference(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    optimizers = torch_optimizers(model)
    for ids in batches(model.config.vocab_size):
        mean_loss(model, ids).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {name: p.detach() for name, p in model.named_parameters()}


def step_reference(reference: torch.nn.Module, optimizers: list, ids: torch.Tensor) -> list[torch.Tensor]:
    """The one-process gradients at the reference's weights (in parameters() order), then its torch step."""
    mean_loss(reference, ids).backward()
    grads = [p.grad.clone() for p in reference.parameters()]
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads


def inject_dtensor_grads(engine, grads: list[torch.Tensor]) -> None:
    """tp: each DTensor gradient shard cut from the one-process gradient, as DTensor places it."""
    from torch.distributed.tensor import DTensor, Replicate

    for p, grad in zip(engine.model.parameters(), grads):
        whole = DTensor.from_local(grad, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
        p.grad.to_local().copy_(whole.redistribute(p.device_mesh, p.placements).to_local())


def inject_zero3_grads(engine, grads: list[torch.Tensor]) -> None:
    """ZeRO-3: each flat fp32 partition's gradient rebuilt from the one-process gradients in DeepSpeed's own order
    (fp16_groups, equal padded parts), just before our optimizer steps it (DeepSpeed has reduced its own by then).
    The weights are read back through DeepSpeed's gather, not through our layout."""
    import torch.distributed as dist

    ds, optimizer = engine.ds.optimizer, engine.optimizer
    index = {id(p): i for i, p in enumerate(engine.model.parameters())}
    subs = {id(flat): sub for sub, flat in enumerate(ds.fp32_partitioned_groups_flat)}
    rank, world, step = dist.get_rank(), dist.get_world_size(), type(optimizer).step

    def injected_step(*args, **kwargs):
        for group in optimizer.param_groups:
            for flat in group["params"]:
                parts = []
                for p in ds.fp16_groups[subs[id(flat)]]:
                    part, whole = p.partition_numel(), grads[index[id(p)]].reshape(-1)
                    padded = torch.cat([whole, whole.new_zeros(part * world - whole.numel())])
                    parts.append(padded[rank * part:(rank + 1) * part])
                flat.grad.copy_(torch.cat(parts))
        return step(optimizer, *args, **kwargs)

    optimizer.step = injected_step


def full_weights(engine, backend: str) -> dict[str, torch.Tensor] | None:
    """The trained weights whole (a collective), on rank 0; None elsewhere."""
    if backend == "deepspeed":
        return engine.gathered_state_dict()
    state = {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
             for name, p in engine.model.named_parameters()}
    return state if engine.ctx.is_main else None


def train_on(ctx, load, backend: str, options: dict, inject: bool) -> dict[str, torch.Tensor] | None:
    from llmtrain.backends import build_backend

    run = {"micro_batch_size": 2, "grad_accum_steps": 1, "output_dir": None}
    engine_backend = build_backend(backend, ctx, "fp32", {**options, "run": run})
    with engine_backend.model_init_context() if backend == "deepspeed" else contextlib.nullcontext():
        model = load()  # ZeRO-3 under zero.Init, as run.py builds it; FSDP2 whole on every rank (its other path)
    engine = engine_backend.wrap(model, spec())
    reference = load() if inject else None
    optimizers = torch_optimizers(reference) if inject else []
    grads: list[torch.Tensor] = []
    if inject and backend == "deepspeed":
        inject_zero3_grads(engine, grads)
    for ids in batches(model.config.vocab_size):
        engine.backward(mean_loss(engine.module, ids) / engine.dp_size)  # this rank's share: dp × the same batch
        if inject:
            grads[:] = step_reference(reference, optimizers, ids)
            if backend == "fsdp2":
                inject_dtensor_grads(engine, grads)
        engine.clip_or_fused_step()
        engine.step()
    return full_weights(engine, backend)


def muon_exactness(ctx, model_dir: Path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")

    reference = torch_reference(load()) if ctx.is_main else None
    diffs = {}
    for name, (backend, options) in CASES.items():
        weights = train_on(ctx, load, backend, options, inject=name in INJECTED)
        if ctx.is_main:
            assert weights.keys() >= reference.keys(), (name, sorted(set(reference) - set(weights))[:3])
            diffs[name] = max(float((weights[k].cpu() - ref).abs().max()) for k, ref in reference.items())
    return diffs
