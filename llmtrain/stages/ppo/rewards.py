"""Where a rollout's scores come from: a frozen reward model (a role), or a Python function.

A reward function is `score(prompts: list, responses: list[str], **columns) -> list[float]`, imported from
`module:attribute` on PYTHONPATH: `prompts` are the raw prompt column, `responses` the decoded text up to
(not including) the EOS; the dataset's other columns are passed as keyword lists when the function takes
them (by name, or all of them through **kwargs), as TRL and verl do.
Scores are then clipped (`clip`), normalised with the reward model's exported mean/std (`normalize`),
and a response cut at max_new_tokens gets `missing_eos_penalty` added.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llmtrain.config import ConfigError
from llmtrain.models.heads import scores_at
from llmtrain.stages.ppo.rollout import Rollout, model_inputs


def load_reward_function(spec: str) -> Callable:
    """`module:attribute` -> the callable (errors name ppo.reward.function and the fix)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"ppo.reward.function={spec!r} must be module:attribute (e.g. my_rewards:score, with "
                          "my_rewards.py on PYTHONPATH)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"ppo.reward.function={spec!r}: cannot import {module_name!r} ({error}); put its folder "
                          "on PYTHONPATH") from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"ppo.reward.function={spec!r}: {module_name} has no callable {attribute!r}")
    return function


def call_reward_function(function: Callable, prompts: list, responses: list[str], columns: dict[str, list]) -> list[float]:
    parameters = inspect.signature(function).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    passed = {k: v for k, v in columns.items() if takes_all or k in parameters}
    scores = list(function(prompts, responses, **passed))
    name = getattr(function, "__qualname__", repr(function))
    if len(scores) != len(responses):
        raise ValueError(f"reward function {name} returned {len(scores)} scores for {len(responses)} responses")
    bad = [s for s in scores if not isinstance(s, (int, float)) or not math.isfinite(s)]
    if bad:
        raise ValueError(f"reward function {name} returned non-finite or non-numeric scores, e.g. {bad[0]!r}")
    return [float(s) for s in scores]


def reward_model_statistics(path: str) -> tuple[float, float] | None:
    """The (reward_mean, reward_std) a reward-model export carries in its config.json (stage=reward writes them)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    values = json.loads(config.read_text())
    if "reward_mean" not in values or "reward_std" not in values:
        return None
    return float(values["reward_mean"]), float(values["reward_std"])


@dataclass(frozen=True)
class ScoreShaping:
    clip: float | None = None
    statistics: tuple[float, float] | None = None  # (mean, std) to normalise with
    missing_eos_penalty: float | None = None

    def apply(self, scores: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
        """(B,) raw scores -> (B,) the scores PPO optimises."""
        if self.statistics is not None:
            mean, std = self.statistics
            scores = (scores - mean) / max(std, 1e-8)
        if self.clip is not None:
            scores = scores.clamp(-self.clip, self.clip)
        if self.missing_eos_penalty is not None:
            scores = scores + (~ended).float() * self.missing_eos_penalty
        return scores


def last_action_positions(rollout: Rollout) -> torch.Tensor:
    """(B,) flat positions in the (B·T) tokens of each row's last action token (its EOS when it has one)."""
    batch, width = rollout.sequences.shape
    prompt_width = width - rollout.num_actions
    last = (rollout.action_mask.long().cumsum(-1).argmax(-1)).clamp(min=0)  # (B,) index of the last True
    return torch.arange(batch, device=last.device) * width + prompt_width + last


@torch.no_grad()
def reward_model_scores(engine, rollout: Rollout, rows: slice) -> torch.Tensor:
    """(b,) the frozen reward model's scores of rows `rows` of the rollout, at each last action token."""
    sequences, mask = rollout.sequences[rows], rollout.attention_mask[rows]
    sub = Rollout(sequences, mask, rollout.action_mask[rows], rollout.ended[rows], [], {}, rollout.real[rows])
    with engine.autocast():
        return scores_at(engine.module, engine.model, last_action_positions(sub), **model_inputs(sequences, mask))
