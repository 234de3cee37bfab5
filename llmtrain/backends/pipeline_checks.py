"""Pipeline parallelism (`backend.pp`) before anything loads: the checks, and the split of the decoder's blocks over
the stages by cost. Pure Python (no torch.distributed): the config checks, the planner and the unit tests use it;
backends/pipeline.py builds the stages from `split_blocks`.

What runs under pp > 1 today (backends/pipeline.py): pretrain and SFT (packed or not), the reward model, DPO (its
reference log-probs precomputed through the policy's pipeline: stages/dpo.py), SimPO and ORPO (a pair's two sequences
in one micro-batch, padded rows or one packed row), with eval, on the fsdp2 backend, dp × pp × tp, schedules gpipe /
1f1b / interleaved_1f1b / zb / zbv (the zero-bubble ones with backend.reshard_after_forward=false), a decoder with a
`model.layers` stack (tied embeddings too, but not under zbv), fp32 or bf16.
Everything else is refused here by name, with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from llmtrain.parallel.dimension import degree_of  # not the package: parallel/pp.py imports this module


class Schedule(NamedTuple):
    """What the checks, the split, the engine and the planner ask about a torch.distributed.pipelining schedule."""
    torch_class: str
    multi: bool  # several stages per rank (a list of stages; backend.pp_virtual_stages of them)
    full_pipe: bool  # needs M >= pp micro-batches (trainer.grad_accum_steps)
    min_v: int = 1  # backend.pp_virtual_stages allowed: min_v .. max_v
    max_v: int | None = None
    rounds: bool = False  # torch splits M into rounds of ~pp micro-batches (M % rounds == 0)
    split_backward: bool = False  # backward split into an input pass (I) and a weight pass (W)
    v_shape: bool = False  # rank r holds stages r and 2P−1−r (else looped: r, r + P, ...)


SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", False, False, max_v=1),
    "1f1b": Schedule("Schedule1F1B", False, True, max_v=1),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", True, True, min_v=2, rounds=True),
    "zb": Schedule("ScheduleInterleavedZeroBubble", True, True, rounds=True, split_backward=True),
    "zbv": Schedule("ScheduleZBVZeroBubble", True, True, min_v=2, max_v=2, split_backward=True, v_shape=True),
}


def schedule_problems(backend: Any) -> list[str]:
    """backend.pp_schedule / backend.pp_virtual_stages on their own (the degrees are ParallelDims')."""
    pp, name, v = backend.pp, backend.pp_schedule, backend.pp_virtual_stages
    if name not in SCHEDULES:
        return [f"backend.pp_schedule={name} is not one of {', '.join(SCHEDULES)}"]
    schedule = SCHEDULES[name]
    if v < 1:
        return [f"backend.pp_virtual_stages={v} must be >= 1"]
    if schedule.max_v == 1 and v != 1:
        return [f"backend.pp_virtual_stages={v} needs backend.pp_schedule=interleaved_1f1b, zb or zbv ({name} runs "
                "one stage per rank); set backend.pp_virtual_stages=1 or backend.pp_schedule=interleaved_1f1b"]
    if pp > 1 and schedule.max_v == schedule.min_v == 2 and v != 2:
        return [f"backend.pp_schedule={name} ({schedule.torch_class}) places exactly 2 stages per rank in a V (rank "
                f"r: stages r and 2·pp−1−r): set backend.pp_virtual_stages=2 (it is {v})"]
    if pp > 1 and v < schedule.min_v:
        return [f"backend.pp_schedule={name} interleaves several stages per rank: set backend.pp_virtual_stages "
                f">= {schedule.min_v} (backend.pp={pp}), or use backend.pp_schedule=1f1b for one stage per rank"]
    if pp > 1 and schedule.split_backward and getattr(backend, "reshard_after_forward", False):
        return [f"backend.pp_schedule={name} splits each backward into an input pass and a later weight pass, which "
                "reach a block's weights only while FSDP keeps them gathered (a block resharded after its forward "
                "loses its weight gradients: torch's stage_backward_input sees the sharded parameters); set "
                "backend.reshard_after_forward=false (the schedule gathers and frees each stage as a whole)"]
    return []


def unsupported_settings(backend: Any) -> list[str]:
    """fsdp2 fields the pipeline does not combine with yet."""
    pp, bad = backend.pp, []
    if backend.compile:
        bad.append(f"backend.pp={pp} with backend.compile=true is not tested yet; set backend.compile=false")
    if backend.cpu_offload:
        bad.append(f"backend.pp={pp} with backend.cpu_offload=true is not tested yet; set backend.cpu_offload=false")
    return bad


def run_problems(cfg: Any, stage: Any) -> list[str]:
    """What the rest of the config must be for backend.pp > 1 (validation.py; every rank, nothing loaded). stage: the
    run's stages/spec.StageSpec (`pipelines`: it runs through a pipeline; `prompts`: it generates)."""
    backend = cfg.backend
    pp = degree_of(backend, "pp")
    if pp <= 1:
        return []
    problems = []
    if stage.prompts:
        problems.append(f"stage={stage.name} with backend.pp={pp}: a rollout generates token by token, and a pipeline "
                        "would pass every new token through all its stages; use backend.pp=1 (fsdp2 with "
                        "backend.tp for a model that does not fit one rank)")
    elif not stage.pipelines:
        problems.append(f"stage={stage.name} with backend.pp={pp}: this stage does not run through a pipeline "
                        "(its StageSpec has pipelines=False); set backend.pp=1")
    schedule = SCHEDULES.get(backend.pp_schedule)
    m = cfg.trainer.grad_accum_steps
    if schedule is not None and schedule.full_pipe and m < pp:
        problems.append(f"trainer.grad_accum_steps={m} < backend.pp={pp}: {backend.pp_schedule} keeps pp micro-"
                        f"batches in flight, and the pipeline's micro-batches are the step's; raise "
                        f"trainer.grad_accum_steps to >= {pp} (the global batch grows with it) or use "
                        "backend.pp_schedule=gpipe")
    rounds = max(1, m // pp)
    if schedule is not None and schedule.rounds and m % rounds:
        problems.append(f"trainer.grad_accum_steps={m} does not split into {rounds} equal rounds for "
                        f"{backend.pp_schedule} (torch's {schedule.torch_class}: rounds of ~backend.pp={pp} "
                        f"micro-batches); use a multiple of {pp}, or at most {2 * pp - 1}")
    if cfg.precision == "fp16":
        problems.append(f"precision=fp16 with backend.pp={pp}: the loss scaler is not applied inside the pipeline's "
                        "backward; use precision=bf16 or fp32")
    return problems


def model_problems(backend: Any, layers: int, experts: int, model_type: str, layer_stack: bool = True,
                   tied: bool = False) -> list[str]:
    """The architecture against pp · v stages (config.json, no weights). layer_stack: the model has the
    model.layers / embed_tokens / norm / lm_head names the split works on. (Tied embeddings are fine: a copy on the
    first stage and one on the last, their gradients summed: backends/pipeline_engine.py.)"""
    pp, v = backend.pp, backend.pp_virtual_stages
    if pp <= 1:
        return []
    if not layer_stack:
        return [f"{model_type} does not name its blocks model.layers (with model.embed_tokens, model.norm, lm_head), "
                f"which backend.pp={pp} splits into stages; use backend.pp=1 (fsdp2 shards it), or a Llama-style "
                "family (llama, qwen2, qwen3, mistral)"]
    problems = []
    schedule = SCHEDULES.get(backend.pp_schedule)
    stages = pp * max(1, v) if schedule is not None and schedule.multi else pp
    if layers < stages:
        problems.append(f"{model_type} has {layers} decoder blocks, fewer than backend.pp={pp} × "
                        f"backend.pp_virtual_stages={v} = {stages} stages; lower backend.pp or "
                        "backend.pp_virtual_stages")
    if tied and schedule is not None and schedule.v_shape:
        problems.append(f"{model_type} ties its input and output embeddings, and {backend.pp_schedule}'s V puts the "
                        "first and the last stage (both copies) on pp rank 0, which the tied gradient sum and "
                        "checkpoint loading do not handle yet; use backend.pp_schedule=zb or interleaved_1f1b")
    if experts:
        problems.append(f"{model_type} is a mixture of experts: its routers' aux loss spans every stage, which the "
                        f"pipeline does not gather yet; use backend.pp=1")
    return problems


# ---- the split by cost --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageCosts:
    """Training cost per token of each piece (forward + backward FLOPs, metrics/flops.py's model): a block 6·params
    + 12·h·s (attention scores and values), the head 6·h·V, the embedding 2·h (a row gathered, its gradient
    scattered: no matmul)."""
    block: float
    embed: float
    head: float

    @classmethod
    def of(cls, block_params: int, hidden: int, vocab: int, seq_len: int, head_params: int) -> StageCosts:
        return cls(block=6.0 * block_params + 12.0 * hidden * seq_len, embed=2.0 * hidden,
                   head=6.0 * head_params + 2.0 * hidden)  # + the final norm


def split_blocks(layers: int, stages: int, costs: StageCosts) -> list[range]:
    """Contiguous blocks per stage (each at least one), the embedding on stage 0 and the head on the last, so that
    the costliest stage is as cheap as it can be (ties: earlier stages take fewer blocks, as they also hold more
    micro-batches' activations under 1F1B)."""
    if layers < stages:
        raise ValueError(f"{layers} decoder blocks cannot fill {stages} pipeline stages")

    def cost(stage: int, first: int, end: int) -> float:
        extra = (costs.embed if stage == 0 else 0.0) + (costs.head if stage == stages - 1 else 0.0)
        return (end - first) * costs.block + extra

    # best[s][i]: the least max cost of stages 0..s-1 holding blocks 0..i-1 (each stage >= 1 block)
    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for end in range(s, layers - (stages - s) + 1):
            for first in range(s - 1, end):
                value = max(best[s - 1][first], cost(s - 1, first, end))
                if value < best[s][end]:  # strict: on a tie the earliest cut stays (later stages take more)
                    best[s][end], cut[s][end] = value, first
    bounds, end = [], layers
    for s in range(stages, 0, -1):
        bounds.append(range(cut[s][end], end))
        end = cut[s][end]
    return bounds[::-1]


def describe_stage(stage: int, stages: int, blocks: range) -> str:
    """`embed + blocks 0-13`, `blocks 14-27 + norm + head` (the run log's line per stage)."""
    parts = (["embed"] if stage == 0 else []) + [f"blocks {blocks.start}-{blocks.stop - 1}" if len(blocks) > 1
                                                  else f"block {blocks.start}"]
    return " + ".join(parts + (["norm + head"] if stage == stages - 1 else []))


def stage_ranks(stage: int, pp: int, v_shape: bool = False) -> int:
    """The pp rank that holds `stage`: looped placement, rank r holds stages r, r + pp, ...; V-shaped (zbv, 2 stages
    per rank), rank r holds stages r and 2·pp−1−r."""
    return stage % pp if not v_shape or stage < pp else 2 * pp - 1 - stage


def rank_stages(rank: int, pp: int, stages: int, v_shape: bool = False) -> list[int]:
    """The stages pp rank `rank` holds, in stage order (stage_ranks' inverse)."""
    return [s for s in range(stages) if stage_ranks(s, pp, v_shape) == rank]
