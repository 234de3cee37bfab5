"""Run under torchrun by tests/dist/test_expert_parallel.py (gloo, fp32): `torchrun --nproc_per_node N -m
tests.dist.workers.expert_parallel_checks OUT_DIR` writes OUT_DIR/rank_<r>.json.

For each family (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert; tiny, from config) and each layout of the
world (ep = 2 beside tp = 1: dp = world, efsdp = world/2; ep = tp = 2: dp = world/2), one model built the same on
every rank is split as the lead's wiring will: tp on the dense layers (experts left out), experts over ep
(models/expert_parallel.py), the experts fully_shard-ed on efsdp with their gradient scale, the blocks and the root on
the dp mesh. Its loss is llmtrain's (this rank's share of the global token mean + coef × this rank's router aux loss /
dp, backward × dp, as backends/fsdp2.py). The reference: the same weights whole on this one process, every dp rank's
rows through it separately (a DDP run's per-rank router terms), the summed loss backward once. Compared: logits and
router logits of this rank's rows, aux loss and busiest-expert load, every gradient (full tensors after FSDP's
reduction), this rank's local expert slice, and the all-to-all bytes the live meter counts (metrics/comm.py) against
`all_to_all_bytes`.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
            "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
            "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48)}
ROWS, WIDTH = 4, 8  # per dp rank (2 MoE layers, 4 experts: the skewed test's byte count)


def _meshes(world: int, tp: int, ep: int) -> dict:
    """The dense view (dp_shard, tp) and, carved from the same ranks, the expert view (efsdp, ep), ep innermost: one
    root mesh, as FSDP needs for the experts' 2-D (efsdp, ep) parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    dense = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    flat = dense[("dp_shard", "tp")]._flatten("dp_shard_tp")
    experts = flat._unflatten(0, (world // ep, ep), ("efsdp", "ep"))
    return {"dp": dense["dp_shard"], "tp": dense["tp"] if tp > 1 else None, "tp_view": dense["tp"],
            "efsdp": experts["efsdp"], "ep": experts["ep"]}


def _parallelize(model, config, meshes) -> None:
    """tp (experts left out) -> ep -> experts on efsdp -> blocks and root on dp: the order the wiring must keep."""
    from torch.distributed.fsdp import fully_shard

    from llmtrain.models.expert_parallel import apply_expert_parallel, shard_experts
    from llmtrain.models.tp import apply_tp_plan

    if meshes["tp"] is not None:
        apply_tp_plan(model, meshes["tp"], config, experts=False)
    assert apply_expert_parallel(model, meshes["ep"], meshes["tp"]) == config.num_hidden_layers
    shard_experts(model, meshes["efsdp"], dp_size=meshes["dp"].size())
    for block in model.model.layers:
        fully_shard(block, mesh=meshes["dp"])
    fully_shard(model, mesh=meshes["dp"], reshard_after_forward=False)


def _rank_terms(model, router, ids, targets: int, dp: int):
    """(this dp rank's loss: its LM sum / global targets + coef·aux/dp, logits (B, T, V), router logits, aux, load)."""
    import torch

    from llmtrain.models.moe import router_losses

    out = model(input_ids=ids, output_router_logits=True)
    logits = out.logits  # (B, T, V)
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                           reduction="sum")
    aux, load = router_losses(router, out.router_logits, torch.ones(ids.shape))
    return lm / targets + router.coef * aux / dp, logits, out.router_logits, aux, load


def _full_state_equal(model, reference) -> bool:
    """The full state dict gathered from the (efsdp, ep) and (dp, tp) shards (what the HF export and a resume at
    another layout read) is the one-process model's, name for name and bit for bit."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = reference.state_dict()
    return state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.abs().max() > 0 else float(a.abs().max())


def _case(family: str, tp: int, ep: int, rank: int, world: int, skewed: bool = False) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.metrics.comm import CommCounter
    from llmtrain.models.expert_parallel import all_to_all_bytes
    from llmtrain.models.moe import router_of

    config = AutoConfig.for_model(family, **SIZES, **FAMILIES[family], router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    if skewed:  # equal router logits: top-k takes experts 0 and 1 for every token, ep rank 1 receives no row
        for layer in reference.model.layers:
            layer.mlp.gate.weight.data.zero_()
    model = copy.deepcopy(reference)
    router = router_of(reference)
    meshes = _meshes(world, tp, ep)
    dp, dp_rank = meshes["dp"].size(), meshes["dp"].get_local_rank()
    batches = torch.randint(0, SIZES["vocab_size"], (dp, ROWS, WIDTH), generator=torch.Generator().manual_seed(1))
    targets = dp * ROWS * (WIDTH - 1)

    _parallelize(model, config, meshes)
    exported = _full_state_equal(model, reference)
    counter = CommCounter()
    with counter.counting():
        loss, logits, router_logits, aux, load = _rank_terms(model, router, batches[dp_rank], targets, dp)
        (loss * dp).backward()  # FSDP averages over dp (backends/fsdp2.py)
    ref_terms = [_rank_terms(reference, router, batches[r], targets, dp) for r in range(dp)]
    sum(t[0] for t in ref_terms).backward()
    _, ref_logits, ref_router, ref_aux, ref_load = ref_terms[dp_rank]
    return {"loss_rel": abs(float(loss - ref_terms[dp_rank][0])) / float(ref_terms[dp_rank][0]),
            "logits_max_abs": float((logits - ref_logits).abs().max()),
            "router_logits_max_abs": max(float((a - b).abs().max()) for a, b in zip(router_logits, ref_router)),
            "aux_equal": float(aux) == float(ref_aux), "load_equal": float(load) == float(ref_load),
            **_grad_report(model, reference, ep, meshes),
            "all_to_all_payload": counter.payload["all_to_all"],
            "all_to_all_planned": all_to_all_bytes(config, ROWS * WIDTH, ep=ep, tp=tp),
            "full_state_equal": exported, "dp": dp, "efsdp": meshes["efsdp"].size()}


def _grad_report(model, reference, ep: int, meshes) -> dict:
    """Every gradient after FSDP's reduction (full tensors) against the reference's; with efsdp = 1, this rank's own
    gradient shard is its E/ep experts' slice of the reference's."""
    import torch

    ref = dict(reference.named_parameters())
    experts, dense, slices, local_rows = 0.0, 0.0, 0.0, None
    rank = meshes["ep"].get_local_rank()
    for name, param in model.named_parameters():
        grad, expected = _full(param.grad), ref[name].grad
        expected = torch.zeros_like(grad) if expected is None else expected  # an expert no token reached
        if ".experts." not in name:
            dense = max(dense, _max_rel(grad, expected))
            continue
        experts = max(experts, _max_rel(grad, expected))
        local_rows = param.to_local().shape[0]
        if meshes["efsdp"].size() == 1:
            rows = expected.shape[0] // ep
            own = param.grad.to_local()  # (E/ep, ...)
            slices = max(slices, float((own - expected[rank * rows:(rank + 1) * rows]).abs().max()))
    return {"expert_grad_max_rel": experts, "dense_grad_max_rel": dense, "expert_slice_max_abs": slices,
            "expert_local_rows": local_rows}


def transformers_all_to_all_counted(rank: int, world: int) -> dict:
    """transformers' own AllToAllEP on the same model: what the live meter sees of its exchanges."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from llmtrain.metrics.comm import CommCounter

    config = AutoConfig.for_model("mixtral", **SIZES, **FAMILIES["mixtral"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    meshes = _meshes(world, 1, 2)
    apply_expert_parallelism(model, meshes["ep"], meshes["tp_view"], model._expand_parallel_plan(model.ep_plan),
                             ep_implementation="all_to_all")
    counter = CommCounter()
    with counter.counting():
        model(input_ids=torch.randint(0, 64, (ROWS, WIDTH))).logits.sum().backward()
    return {"all_to_all_payload": counter.payload["all_to_all"]}


def worker(out_dir: Path) -> None:
    import torch.distributed as dist

    from llmtrain.distributed import init_distributed, shutdown

    ctx = init_distributed("cpu", 300)
    report = {"rank": ctx.rank, "world": ctx.world_size}
    for tp in (1, 2):
        for family in FAMILIES:
            report[f"{family}_ep2_tp{tp}"] = _case(family, tp, 2, ctx.rank, ctx.world_size)
    report["mixtral_skewed"] = _case("mixtral", 1, 2, ctx.rank, ctx.world_size, skewed=True)
    report["transformers_all_to_all"] = transformers_all_to_all_counted(ctx.rank, ctx.world_size)
    dist.barrier()
    (out_dir / f"rank_{ctx.rank}.json").write_text(json.dumps(report, indent=1))
    shutdown()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    worker(out)
