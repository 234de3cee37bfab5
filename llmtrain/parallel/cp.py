"""Context parallelism (`backend.cp`): ring attention (models/ring_attention.py). cp peers share each row, 2 zig-zag
chunks of s/(2·cp) tokens each (data/sequence_shard.py), and pass key/value blocks round the ring in every attention:
cp − 1 point-to-point sends of this rank's k and v per layer forward, as many again and cp sends of their gradients
backward. No head count limits it. With sp (Ulysses) inside it: sp peers split a cp rank's tokens, exchange them for
heads, and the ring runs on the cp rank's tokens of the sp rank's heads. Between dp_shard and sp in the mesh (its
point-to-point sends are fewer bytes per step than sp's all-to-alls); cp peers hold the same weights (fully_shard
folds them into dp_shard: ParallelDims' row views) and read the same examples. The attention wrapper is applied where
attention is resolved (run.py, llmtrain/sequence_parallel.py); the config's checks: llmtrain/sequence_parallel.py.

`backend.cp_implementation` picks the ring: `ring` (llmtrain's, above), `torch` (torch's context parallelism, its
SDPA kernels dispatched on DTensors: models/torch_context_parallel.py; refused where it cannot run, `torch_cp_blocker`
says why), `auto` = the ring. torch's path has not run on a GPU yet (tests/gpu/test_context_parallel.py compares the
two on the same batch): until it has, `auto` does not pick it, and `torch` is the user's explicit choice."""

from __future__ import annotations

from typing import Any

from llmtrain.parallel.dimension import Dimension, register


def _model_problems(cp: int, model_type: str, window: int | None, moe: bool) -> list[str]:
    found = []
    if window is not None:
        found.append(f"backend.cp={cp}: {model_type} has sliding-window layers ({window} tokens), which the ring's "
                     "causal blocks do not keep; set backend.cp=1 (backend.sp keeps them)")
    if moe:
        found.append(f"backend.cp={cp} with an MoE model ({model_type}): the routers' aux loss is a statistic of the "
                     "tokens one forward sees, and a cp rank sees 1/cp of each row; set backend.cp=1")
    return found


def arch_problems(backend: Any, dims: Any, arch: Any) -> list[str]:
    from llmtrain.models.load import sliding_window
    from llmtrain.models.moe import expert_count

    return _model_problems(dims.cp, arch.model_type, sliding_window(arch), bool(expert_count(arch)))


def facts_problems(backend: Any, dims: Any, facts: Any) -> list[str]:
    return _model_problems(dims.cp, facts.model_type, None, facts.experts > 0)


def collectives(layout: Any, facts: Any, precision: str, *, tokens_per_micro: int, accum: int, trainable: bool,
                checkpointing: bool) -> list:
    """Per layer and forward, cp − 1 sends of this rank's k and v (tokens_per_micro of them after Ulysses' exchange
    splits heads, kv_hidden/tp wide); backward as many of k and v again and cp of their fp32 gradients; a checkpointed
    block's recompute sends its forward's again."""
    from llmtrain.metrics.cost import Collective, elem_bytes

    kv_width = facts.kv_heads * (facts.hidden // facts.heads) / layout.tp
    block = 2 * tokens_per_micro * kv_width  # k and v elements this rank sends per step of the ring
    forwards = (1 + (1 if trainable and checkpointing else 0)) * facts.layers * accum
    out = [Collective("CP ring k/v forward", "p2p", elem_bytes(precision) * block, layout.cp,
                      forwards * (layout.cp - 1), overlapped=True)]
    if trainable:
        out.append(Collective("CP ring k/v and their gradients backward", "p2p",
                              block * (elem_bytes(precision) * (layout.cp - 1) + 4 * layout.cp), layout.cp,
                              facts.layers * accum, overlapped=True))
    return out


def plan_line(st: Any, row: Any) -> str:
    lay = row.layout
    return (f"{lay.name}: dp {lay.dp} × cp {lay.cp}, {-(-st.seq // lay.row_split)} tokens of each row per rank "
            f"(2 zig-zag chunks; {lay.cp - 1} key/value sends per layer forward)")


CP_IMPLEMENTATIONS = ("auto", "ring", "torch")


def torch_cp_blocker(device_type: str, packed: bool, degrees: dict) -> str | None:
    """Why torch's context parallelism cannot run this layout (None: it can). Its ring dispatches only CUDA's SDPA
    kernels (flash, memory-efficient, cuDNN; the CPU flash kernel has no sharding strategy), causal attention with
    no mask (so no packed rows), on plain tensors of one cp mesh: Ulysses' and tp's heads around it have never run."""
    if device_type != "cuda":
        return (f"on {device_type} torch's ring has no kernel (it dispatches CUDA's SDPA kernels only; "
                "aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy)")
    if packed:
        return "data.packing=true puts several samples in a row, and torch's ring attends causally with no mask"
    for name in ("sp", "tp"):
        if degrees.get(name, 1) > 1:
            return f"backend.{name}={degrees[name]}: torch's ring inside {name}'s head split has never been run"
    return None


def cp_implementation(backend: Any) -> str:
    """"ring" or "torch": what backend.cp_implementation (absent: auto) runs (`torch` where it cannot run is refused
    before: config_problems)."""
    requested = getattr(backend, "cp_implementation", "auto")
    return "ring" if requested == "auto" else requested  # auto: the ring, the path tested here (module docstring)


def implementation_problems(backend: Any, degrees: dict) -> list[str]:
    """backend.cp_implementation's value, and `torch` where no cp runs (Dimension.problems: degrees alone)."""
    requested = getattr(backend, "cp_implementation", "auto") if backend is not None else "auto"
    if requested not in CP_IMPLEMENTATIONS:
        return [f"backend.cp_implementation={requested}: not one of {' | '.join(CP_IMPLEMENTATIONS)}; set "
                "backend.cp_implementation=auto"]
    if requested == "torch" and degrees["cp"] <= 1:
        return [f"backend.cp_implementation=torch with backend.cp={degrees['cp']}: there is no context parallelism "
                "to run; set backend.cp=2 (or more) or backend.cp_implementation=auto"]
    return []


def config_problems(cfg: Any, device_type: str, packed: bool, degrees: dict) -> list[str]:
    """backend.cp_implementation=torch where torch's context parallelism cannot run (torch_cp_blocker), on every rank
    before any model loads."""
    if getattr(cfg.backend, "cp_implementation", "auto") != "torch" or degrees.get("cp", 1) <= 1:
        return []
    why = torch_cp_blocker(device_type, packed, degrees)
    return [] if why is None else [f"backend.cp_implementation=torch with backend.cp={degrees['cp']}: {why}; set "
                                   "backend.cp_implementation=ring (or auto, which picks the ring here)"]


CP = register(Dimension(name="cp", position=25, same_data=True, shares_rows=True, problems=implementation_problems,
                        arch_problems=arch_problems, facts_problems=facts_problems,
                        collectives=collectives, plan_line=plan_line,
                        elsewhere="DDP keeps whole rows on every rank"))
