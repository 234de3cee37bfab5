"""Pipeline parallelism (`backend.pp`) before anything loads: the checks, and the split of the decoder's blocks over
the stages by cost. Pure Python (no torch.distributed): the config checks, the planner and the unit tests use it;
backends/pipeline.py builds the stages from `split_blocks`.

What runs under pp > 1 today (backends/pipeline.py): pretrain and SFT (packed or not), the reward model, DPO (its
reference log-probs precomputed through the policy's pipeline: stages/dpo.py), SimPO and ORPO (a pair's two sequences
in one micro-batch, padded rows or one packed row), with eval, on the fsdp2 backend, dp × pp × tp, schedules gpipe /
1f1b / interleaved_1f1b, a decoder with a `model.layers` stack (tied embeddings too), fp32 or bf16.
Everything else is refused here by name, with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmtrain.backends.spec import pp_of

# schedule name -> (torch.distributed.pipelining class, several stages per rank, needs M >= pp)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False, False),
    "1f1b": ("Schedule1F1B", False, True),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True, True),
}
# Refused by name. Measured (torch 2.13, 2 CPU ranks, FSDP2 stages): zb runs, but step 1's grad norm is 5.985 against
# one process's 7.534, with the fused head and without (its split input/weight backward loses weight gradients);
# zbv needs the V-shaped stage placement (rank r: stages r and 2P−1−r), which the split does not make yet.
LATER_SCHEDULES = {"zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def schedule_problems(backend: Any) -> list[str]:
    """backend.pp_schedule / backend.pp_virtual_stages on their own (the degrees are ParallelDims')."""
    pp, schedule, v = backend.pp, backend.pp_schedule, backend.pp_virtual_stages
    if schedule in LATER_SCHEDULES:
        return [f"backend.pp_schedule={schedule} ({LATER_SCHEDULES[schedule]}: zero-bubble, split input/weight "
                f"backward) is not wired up yet; use backend.pp_schedule=1f1b or interleaved_1f1b"]
    if schedule not in SCHEDULES:
        return [f"backend.pp_schedule={schedule} is not one of {', '.join(SCHEDULES)}"]
    if v < 1:
        return [f"backend.pp_virtual_stages={v} must be >= 1"]
    if SCHEDULES[schedule][1] and pp > 1 and v < 2:
        return [f"backend.pp_schedule={schedule} interleaves several stages per rank: set backend.pp_virtual_stages "
                f">= 2 (backend.pp={pp}), or use backend.pp_schedule=1f1b for one stage per rank"]
    if not SCHEDULES[schedule][1] and v != 1:
        return [f"backend.pp_virtual_stages={v} needs backend.pp_schedule=interleaved_1f1b ({schedule} runs one "
                "stage per rank); set backend.pp_virtual_stages=1 or backend.pp_schedule=interleaved_1f1b"]
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
    pp = pp_of(backend)
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
    if schedule is not None and schedule[2] and m < pp:
        problems.append(f"trainer.grad_accum_steps={m} < backend.pp={pp}: {backend.pp_schedule} keeps pp micro-"
                        f"batches in flight, and the pipeline's micro-batches are the step's; raise "
                        f"trainer.grad_accum_steps to >= {pp} (the global batch grows with it) or use "
                        "backend.pp_schedule=gpipe")
    rounds = max(1, m // pp)
    if schedule is not None and schedule[1] and m % rounds:
        problems.append(f"trainer.grad_accum_steps={m} does not split into {rounds} equal rounds for "
                        f"{backend.pp_schedule} (torch's ScheduleInterleaved1F1B: rounds of ~backend.pp={pp} "
                        f"micro-batches); use a multiple of {pp}, or at most {2 * pp - 1}")
    if cfg.peft.name != "none":
        problems.append(f"peft={cfg.peft.name} with backend.pp={pp}: adapters over pipeline stages are not wired up "
                        "yet; use peft=none or backend.pp=1")
    if cfg.precision == "fp16":
        problems.append(f"precision=fp16 with backend.pp={pp}: the loss scaler is not applied inside the pipeline's "
                        "backward; use precision=bf16 or fp32")
    return problems


def model_problems(backend: Any, layers: int, experts: int, model_type: str, layer_stack: bool = True) -> list[str]:
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
    stages = pp * max(1, v) if SCHEDULES.get(backend.pp_schedule, (0, False))[1] else pp
    if layers < stages:
        problems.append(f"{model_type} has {layers} decoder blocks, fewer than backend.pp={pp} × "
                        f"backend.pp_virtual_stages={v} = {stages} stages; lower backend.pp or "
                        "backend.pp_virtual_stages")
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


def stage_ranks(stage: int, pp: int) -> int:
    """The pp rank that holds `stage` (looped placement: rank r holds stages r, r + pp, ...)."""
    return stage % pp
