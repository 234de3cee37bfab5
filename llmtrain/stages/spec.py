"""A stage as one spec: everything the rest of the program asks about a stage, declared by the stage's module.

The run, the trainer, the planner, the sinks, `finished_run` and validation ask `stages.registry`; none of them
names a stage. To add one:
- `stages/x.py`: the Stage class (subclass `stages.base.Stage`), `build(cfg, source, tokenizer, attn) -> Stage`,
  its config dataclass (its own top-level node, e.g. `x.beta`), its `problems(cfg, dp)`, and
  `STAGE_SPECS = (StageSpec(name="x", ...),)`;
- its module name in `stages/registry.py`; `conf/stage/x.yaml` (`name: x`); a tiny recipe; its tests.
Losses are pure functions in `losses/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from llmtrain.stages.base import ModelSource, RoleSpec

SFT_FORMATS = ("prompt_response", "alpaca", "messages")


def no_problems(cfg: Any, dp: int) -> list[str]:
    return []


def no_renames(cfg: Any) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class ImplicitReward:
    """How a policy's log-probs make a pair's reward for inspection (finished_run): β · (log π(y|x) − log π_ref(y|x)),
    the log-probs summed over the response or averaged by its length; without a reference β · log π(y|x)."""
    beta: float
    averaged: bool
    reference: bool


@dataclass(frozen=True)
class RLShape:
    """What shapes a PPO-like iteration for the planner (a step is generation + experience + several updates)."""
    samples: int  # sequences generated per iteration, global
    mini_batch: int  # sequences per optimizer step, global
    epochs: int
    micro: int  # sequences per micro-batch on a rank
    on_policy: bool  # the update's own forward gives the old log-probs (no actor experience forward)
    max_new_tokens: int
    prompts_per_step: int
    samples_per_prompt: int
    token_loss: bool = True  # the policy loss is a sum of per-token terms (fused head: gradients held to backward)


@dataclass(frozen=True)
class StageSpec:
    """One stage, as the rest of the program sees it."""
    name: str
    build: Callable  # (cfg, source: ModelSource, tokenizer, attn_implementation) -> Stage
    roles: Callable[[Any, ModelSource], dict[str, RoleSpec]]  # the roles this config builds (the planner reads it)
    data_formats: tuple[str, ...]  # data.format values the stage trains on
    data_hint: str  # the fix named when data.format is not one of them
    unpaired: bool = False  # trains on unpaired completions: a pair format's pairs unpaired (data/unpaired_format.py)
    count_name: str = "tokens"  # what a step's loss is normalised by: tokens | pairs | ...
    sequences_per_sample: int = 1  # a pair is 2 sequences in one forward
    metric_group: str = "train"  # W&B group of the stage's own metrics (`dpo/rewards_margin`)
    config_node: str | None = None  # its top-level config node ("dpo": `dpo.beta`), shared by sibling stages
    config_class: type | None = None
    problems: Callable[[Any, int], list[str]] = no_problems  # (cfg, dp) -> every problem, each naming field and fix
    column_renames: Callable[[Any], dict[str, str]] = no_renames  # data columns read under the stage's own name
    packs: bool = True  # data.packing applies (pairs and prompts are not packed)
    prompts: bool = False  # the data are prompts to generate from (RL); else tokenised training sequences
    max_prompt_len: Callable[[Any], int] | None = None  # prompts: the room left for a prompt
    rl_shape: Callable[[Any], RLShape] | None = None  # a step is an RL iteration (planner, batch arithmetic)
    token_losses: bool = False  # finished_run: per-token losses of the held-out samples
    pipelines: bool = False  # runs under backend.pp > 1 (its MicroLoss on the last stage: backends/pipeline.py)
    pair_scores: str | None = None  # finished_run: "scalar" (a reward model's score) or "implicit"
    implicit_reward: Callable[[Any], ImplicitReward] | None = None
    sequence_parallel: bool = False  # runs with backend.sp > 1: its losses are sums over target tokens of shards
    lm_loss_sum: bool = False  # its trained loss is the causal-LM sum −Σ log p (model.fused_loss=liger computes it)
    # (cfg, the run's attention) -> the one its roles are built with (PPO: left padding needs a mask); None: as is
    attention: Callable[[Any, str], str] | None = None

    @property
    def pairs(self) -> bool:
        return self.sequences_per_sample == 2

    def role_trainability(self, cfg: Any, source: ModelSource) -> dict[str, bool]:
        return {role: spec.trainable for role, spec in self.roles(cfg, source).items()}
