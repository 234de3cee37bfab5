"""Where a rollout's scores come from: a frozen reward model (a role), or a Python function.

A reward function is `score(prompts: list, responses: list[str], **columns) -> list[float]`, imported from
`module:attribute` on PYTHONPATH: `prompts` are the raw prompt column, `responses` the decoded text up to
(not including) the EOS; the dataset's other columns are passed as keyword lists when the function takes
them (by name, or all of them through **kwargs), as TRL and verl do. TRL-style functions that name their
parameters (`completions`, `prompts`) are called by keyword.
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


RESPONSE_NAMES = ("responses", "completions")  # TRL names them completions


def call_reward_function(function: Callable, prompts: list, responses: list[str],
                         columns: dict[str, list]) -> list[float]:
    """`function(prompts, responses, **columns)`: positionally, or by name when it names its parameters as TRL's
    do (`def f(completions, **kwargs)`, `def f(prompts, completions, answer)`): `prompts`, `completions` or
    `responses`, and the data columns it takes (all of them through **kwargs)."""
    parameters = inspect.signature(function).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    passed = {k: v for k, v in columns.items()
              if (takes_all or k in parameters) and k not in ("prompts", *RESPONSE_NAMES)}
    named = [n for n in RESPONSE_NAMES if n in parameters]
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if named or (takes_all and not positional):  # `def f(**kwargs)`: TRL's keywords
        texts = {n: responses for n in (named or ["completions"])}
        prompt = {"prompts": prompts} if takes_all or "prompts" in parameters else {}
        scores = function(**prompt, **texts, **passed)
    else:
        scores = function(prompts, responses, **passed)
    return checked_scores(scores, len(responses), getattr(function, "__qualname__", repr(function)))


def checked_scores(scores, count: int, name: str) -> list[float]:
    """A list, tuple, array or tensor of `count` finite numbers -> floats; anything else names the function."""
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().float().cpu().reshape(-1).tolist()
    scores = list(scores)
    if len(scores) != count:
        raise ValueError(f"reward function {name} returned {len(scores)} scores for {count} responses")
    values = []
    for score in scores:
        try:
            value = None if isinstance(score, (str, bytes)) or score is None else float(score)  # a bool counts
        except (TypeError, ValueError):
            value = None
        if value is None or not math.isfinite(value):
            raise ValueError(f"reward function {name} returned non-finite or non-numeric scores, e.g. {score!r}: "
                             f"return one finite number per response")
        values.append(value)
    return values


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
