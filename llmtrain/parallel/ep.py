"""Expert parallelism (`backend.ep`, FSDP2): a MoE model's experts split over ep ranks, each token sent to its experts'
ranks and back by all-to-all (models/expert_parallel.py); dense parameters keep their dp / tp layout.

ep is carved out of dp_shard × tp, as transformers 5.25 lays it out (pp × fsdp × tp = pp × efsdp × ep): the
data-parallel size does not change (unlike sp and pp: ep peers read different examples), ep is a multiple of tp
(tp peers split one expert group's experts further), and the ranks that hold the same experts, efsdp =
dp_shard · tp / ep of them, FSDP-shard those experts. Under ep the experts leave tp's plan and are split E/ep here,
beside tp (tp peers share tokens: each sends 1/tp of them). Applied after tp, before FSDP.
"""

from __future__ import annotations

import logging
from typing import Any

from llmtrain.parallel.dimension import Dimension, register, shared_rows

log = logging.getLogger(__name__)


def problems(backend: Any, degrees: dict) -> list[str]:
    ep, tp, pp, shard = degrees["ep"], degrees["tp"], degrees["pp"], degrees["dp_shard"]
    if ep <= 1:
        return []
    found = []
    if ep % tp:
        found.append(f"backend.ep={ep} must be a multiple of backend.tp={tp} (tp peers split one expert group's "
                     f"experts further); pick backend.ep among multiples of {tp}")
    if shard > 0 and (shard * tp) % ep:
        found.append(f"backend.ep={ep} must divide backend.dp_shard × backend.tp = {shard * tp} (experts are split "
                     "over ranks of one data-parallel shard group); change backend.ep, backend.dp_shard or the number "
                     "of processes")
    found += [f"backend.ep={ep} with backend.{name}={degree}: the routers' statistics need whole rows per rank; use "
              "one" for name, degree in shared_rows(degrees).items()]
    if degrees["dp_replicate"] > 1:
        found.append(f"backend.ep={ep} with backend.dp_replicate={degrees['dp_replicate']}: experts sharded over "
                     "replicas (HSDP) are not built yet; use backend.dp_replicate=1")
    if pp > 1:
        found.append(f"backend.ep={ep} with backend.pp={pp}: the pipeline does not split MoE models; use backend.pp=1")
    return found


def arch_problems(backend: Any, dims: Any, arch: Any) -> list[str]:
    """A model with routed experts in its ep plan, their count divisible by ep (models/expert_parallel.py)."""
    from llmtrain.models.expert_parallel import ep_problems

    return ep_problems(arch, dims.ep, dims.tp)


def facts_problems(backend: Any, dims: Any, facts: Any) -> list[str]:
    """The same on the planner's facts: experts to split, their count divisible by ep."""
    if dims.ep <= 1:
        return []
    if not facts.experts:
        return [f"backend.ep={dims.ep}: {facts.model_type} is a dense model (no experts to split); set backend.ep=1"]
    if facts.experts % dims.ep:
        return [f"backend.ep={dims.ep} must divide the model's {facts.experts} experts ({facts.model_type})"]
    return []


def collectives(layout: Any, facts: Any, precision: str, *, tokens_per_micro: int, accum: int, trainable: bool,
                checkpointing: bool) -> list:
    """The tokens' all-to-all to their experts and back, per micro-batch (models/expert_parallel.exchange_bytes: what
    this rank hands to all_to_all_single, the live meter's payload), in the working precision. A frozen role (a
    reference model) exchanges in its forward only."""
    from llmtrain.metrics.cost import Collective, elem_bytes
    from llmtrain.models.expert_parallel import exchange_bytes

    payload = exchange_bytes(experts=facts.experts, top_k=facts.top_k, moe_layers=facts.moe_layers, hidden=facts.hidden,
                             tokens=tokens_per_micro, ep=layout.ep, tp=layout.tp, element_bytes=elem_bytes(precision),
                             recompute=checkpointing and trainable, backward=trainable)
    return [Collective("EP all-to-all (tokens to experts and back)", "all_to_all", payload, layout.ep, accum,
                       overlapped=False)]


def plan_line(st: Any, row: Any) -> str:
    """The experts a rank holds, how they are sharded, and the all-to-all's traffic."""
    f, lay = st.facts, row.layout
    efsdp = lay.efsdp
    exchanged = sum(c.wire for c in row.comm if c.what.startswith("EP all-to-all"))
    held, total = f.expert_params / lay.ep / 1e9, f.expert_params / 1e9
    return (f"{lay.name}: ep {lay.ep} × efsdp {efsdp}: {f.experts // lay.ep} of {f.experts} experts per rank in each "
            f"of {f.moe_layers} MoE layers ({held:.2f} B of {total:.2f} B expert parameters, sharded over {efsdp} "
            f"rank{'s' if efsdp > 1 else ''}); tokens to their experts and back "
            f"{exchanged / 1e9:.1f} GB per rank per step (all-to-all, not overlapped)")


def _views(world, dims) -> dict:
    """"ep" (ranks holding different experts, exchanging tokens) and "efsdp" (ranks holding the same experts, which
    FSDP-shard them), regrouped from dp_shard × tp, ep innermost (an expert group on adjacent ranks)."""
    from llmtrain.models.expert_parallel import efsdp_size

    shard_tp = world["dp_shard"] if dims.tp == 1 else world[("dp_shard", "tp")]._flatten("dp_shard_ep")
    carved = shard_tp._unflatten(0, (efsdp_size(dims.dp_shard, dims.tp, dims.ep), dims.ep), ("efsdp", "ep"))
    return {"ep": carved["ep"], "efsdp": carved["efsdp"]}


def apply(model, dims) -> None:
    """After tp (which leaves the experts to ep): each rank keeps its E/ep experts; tp peers share their tokens."""
    from llmtrain.models.expert_parallel import apply_expert_parallel, efsdp_size
    from llmtrain.models.lora import unwrap_peft
    from llmtrain.models.moe import expert_count

    split = apply_expert_parallel(unwrap_peft(model), dims.mesh("ep"), dims.mesh("tp") if dims.tp > 1 else None,
                                  arch=model.config)
    experts = expert_count(model.config)
    log.info("ep %d: %d experts modules split, %d of %d experts per rank, sharded over efsdp %d", dims.ep, split,
             experts // dims.ep, experts, efsdp_size(dims.dp_shard, dims.tp, dims.ep))


def shard(model, dims, **fsdp_kwargs) -> None:
    """Before the blocks' fully_shard: the experts on "efsdp", their gradients divided by dp (not efsdp: each
    expert's gradient already sums its ep group's tokens; models/expert_parallel.shard_experts)."""
    from llmtrain.models.expert_parallel import shard_experts
    from llmtrain.models.lora import unwrap_peft

    shard_experts(unwrap_peft(model), dims.mesh("efsdp"), dims.dp_size, arch=model.config, **fsdp_kwargs)


EP = register(Dimension(name="ep", position=None, carved_from=("dp_shard", "tp"),
                        elsewhere="DeepSpeed's MoE layer is not transformers' experts module, and DDP keeps every "
                                  "expert on every rank",
                        problems=problems, arch_problems=arch_problems, facts_problems=facts_problems, meshes=_views,
                        apply=apply, shard=shard, collectives=collectives,
                        plan_line=plan_line))
