"""Where a rollout's scores come from: a frozen reward model (a role), a Python function, or a reward server
(`ppo.reward.url`: remote_reward.py, a source like a function).

A reward function is `score(prompts: list, responses: list[str], **columns) -> list[float]`, imported from
`module:attribute` on PYTHONPATH: `prompts` are the raw prompt column, `responses` the decoded text up to
(not including) the stop token; the dataset's other columns are passed as keyword lists when the function takes
them (by name, or all of them through **kwargs), as TRL and verl do. Functions written for TRL (`completions`,
`**kwargs`) run unchanged: called by keyword with TRL's `completions` (conversational for chat prompts),
`completion_ids` and `trainer_state`. Several functions are summed with weights; a None score is skipped, and a
response no function scores gets NaN: unscored, out of its group's statistics with advantage 0 (TRL's rule).
Scores are then clipped (`clip`), normalised with the reward model's exported mean/std (`normalize`),
and a response cut at max_new_tokens gets `missing_eos_penalty` added.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from llmtrain.distributed import all_reduce_sum
from llmtrain.models.heads import scores_at
from llmtrain.stages.ppo.rollout import Rollout, model_inputs
from llmtrain.user_code import load_attribute


def load_reward_function(spec: str) -> Callable:
    """`module:attribute` -> the callable (errors name ppo.reward.function and the fix)."""
    return load_attribute(spec, "ppo.reward.function", example="my_rewards:score")


RESPONSE_NAMES = ("responses", "completions")  # TRL names them completions
TRL_KEYWORDS = ("completion_ids", "trainer_state")  # what else TRL passes by keyword


@dataclass(frozen=True)
class RewardFunction:
    name: str  # `module:attribute`, as the config names it (a reward server: its URL)
    function: Callable  # or an object with score_completions(Completions) (remote_reward.RemoteReward)
    weight: float = 1.0
    metric: str | None = None  # its mean's metric key; None: score_fn_<attribute>


@dataclass
class Completions:
    """One rollout as reward functions see it (TRL's keywords: prompts, completions, completion_ids, trainer_state)."""
    prompts: list  # the raw prompt of each response: a string, or a list of messages
    texts: list[str]  # each response decoded up to, not including, its stop token
    ids: list[list[int]]  # each response's generated tokens through its stop token (TRL's completion_ids)
    columns: dict[str, list]  # the data's other columns, one value per response
    trainer_state: object = None  # transformers.TrainerState with global_step (TRL passes the trainer's own)
    queries: list[str] = field(default_factory=list)  # prompt + response as the model saw them (a reward server's)

    def conversational(self) -> list:
        """TRL's rule: a chat prompt (a list of messages) gets its completion as [{"role": "assistant", ...}]."""
        return [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                for prompt, text in zip(self.prompts, self.texts)]


def load_reward_functions(specs: list[str], weights: list[float] | None = None) -> list[RewardFunction]:
    weights = list(weights) if weights else [1.0] * len(specs)
    return [RewardFunction(spec, load_reward_function(spec), float(w)) for spec, w in zip(specs, weights)]


def call_reward_function(function: Callable, prompts: list, responses: list[str], columns: dict[str, list],
                         completions: Completions | None = None) -> list[float | None]:
    """`function(prompts, responses, **columns)`: positionally, or by name when it names its parameters as TRL's
    do (`def f(completions, **kwargs)`, `def f(prompts, completions, answer)`): `prompts`, `completions` (TRL's
    rule: conversational for chat prompts) or `responses` (text), `completion_ids` and `trainer_state`, and the
    data columns it takes (all of them through **kwargs). None (or NaN) scores a response as missing."""
    parameters = inspect.signature(function).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    passed = {k: v for k, v in columns.items()
              if (takes_all or k in parameters) and k not in ("prompts", *RESPONSE_NAMES, *TRL_KEYWORDS)}
    named = [n for n in RESPONSE_NAMES if n in parameters]
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    trl_names = [n for n in TRL_KEYWORDS if n in parameters]
    if named or trl_names or (takes_all and not positional):  # `def f(**kwargs)`: TRL's keywords
        trl = "completions" in named or not named
        texts = {n: completions.conversational() if n == "completions" and completions else responses
                 for n in (named or (["completions"] if takes_all or "completions" in parameters else []))}
        prompt = {"prompts": prompts} if takes_all or "prompts" in parameters else {}
        extra = {}
        if trl and completions is not None:
            given = {"completion_ids": completions.ids, "trainer_state": completions.trainer_state}
            extra = {k: v for k, v in given.items() if takes_all or k in parameters}
        scores = function(**prompt, **texts, **extra, **passed)
    else:
        scores = function(prompts, responses, **passed)
    return checked_scores(scores, len(responses), getattr(function, "__qualname__", repr(function)))


def combined_scores(functions: list[RewardFunction], completions: Completions,
                    group=None) -> tuple[list[float], dict[str, float]]:
    """Σ_f weight_f · score_f per response, a function's missing scores (None) skipped as TRL does (nansum), NaN for
    a response no function scored (TRL's unscorable completion: make_experience leaves it out of its group's
    statistics and gives it advantage 0); (scores, each function's mean over the responses it scored on every
    data-parallel rank, keyed by its name).

    Collective: every rank of `group` (the actor's dp group; None: every rank) calls it at the same point, and one
    all-reduce of each function's (sum, count) gives every rank the global mean, as `stages.base.reduce_sums` does
    for the step's other means. A function that scored none of this rank's responses is fine; one that scored none
    of the step's (every score None or NaN on every rank) is an error on every rank (no rank is left waiting), and so
    is a function (or a reward server) that raises on any rank: its error there, a pointer to it on the others."""
    totals = [math.nan] * len(completions.texts)  # NaN until a function scores the response
    sums, failure = [], None  # per function: (Σ scores, count) of the responses it scored on this rank
    for reward in functions:
        try:
            scores = _scores_of(reward, completions)
        except Exception as error:  # raised below on every rank at once, not here alone (the others would wait)
            failure, scores = failure or error, [None] * len(completions.texts)
        present = [s for s in scores if s is not None]
        sums += [math.fsum(present), len(present)]
        totals = [t if s is None else reward.weight * s + (0.0 if math.isnan(t) else t)
                  for t, s in zip(totals, scores)]
    flags = [float(failure is not None)] if functions else []
    reduced = all_reduce_sum(torch.tensor(sums + flags, dtype=torch.float64), group).tolist() if functions else []
    if failure is not None:
        raise failure
    if reduced and reduced.pop() > 0:
        raise RuntimeError("a reward source failed on another data-parallel rank (its log names it and why); this "
                           "rank stops with it")
    means = {}
    for reward, total, count in zip(functions, reduced[0::2], reduced[1::2]):
        if count == 0:
            raise ValueError(f"reward function {reward.name} scored none of the step's responses (every score None "
                             "or NaN, on every rank): return a number for the responses it applies to")
        means[reward.name] = total / count
    return totals, means


def query_texts(tokenizer, rollout: Rollout) -> list[str]:
    """Each sequence as the model saw it: the prompt's tokens and the response's through its stop token, padding
    dropped, special tokens kept (what OpenRLHF sends a reward server as `query`)."""
    sequences, mask = rollout.sequences.cpu(), rollout.attention_mask.cpu().bool()
    return tokenizer.batch_decode([row[m].tolist() for row, m in zip(sequences, mask)], skip_special_tokens=False)


def reads_queries(functions: list[RewardFunction]) -> bool:
    return any(hasattr(reward.function, "score_completions") for reward in functions)


def _scores_of(reward: RewardFunction, completions: Completions) -> list[float | None]:
    if hasattr(reward.function, "score_completions"):  # a reward server: it reads the queries too
        return reward.function.score_completions(completions)
    return call_reward_function(reward.function, completions.prompts, completions.texts, completions.columns,
                                completions)


def score_metrics(functions: list[RewardFunction], means: dict[str, float]) -> dict[str, float]:
    """The per-function means as flat metric keys: `score_fn_<attribute>` (`my_rewards:format_reward` ->
    `score_fn_format_reward`, beside `score`, their weighted sum's mean), the whole spec in the key where two
    functions share an attribute name."""
    attributes = [f.name.rpartition(":")[2] for f in functions]
    keys = {}
    for reward, attribute in zip(functions, attributes):
        name = attribute if attributes.count(attribute) == 1 else reward.name
        keys[reward.name] = reward.metric or "score_fn_" + "".join(c if c.isalnum() else "_" for c in name)
    return {keys[name]: mean for name, mean in means.items()}


def checked_scores(scores, count: int, name: str) -> list[float | None]:
    """A list, tuple, array or tensor of `count` numbers -> floats, None (or NaN) for a response the function does
    not score; anything else (a string, an infinity, a wrong count) names the function."""
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().float().cpu().reshape(-1).tolist()
    scores = list(scores)
    if len(scores) != count:
        raise ValueError(f"reward function {name} returned {len(scores)} scores for {count} responses")
    values = []
    for score in scores:
        if score is None:
            values.append(None)
            continue
        try:
            value = None if isinstance(score, (str, bytes)) else float(score)  # a bool counts
        except (TypeError, ValueError):
            value = None
        if value is None or math.isinf(value):
            raise ValueError(f"reward function {name} returned infinite or non-numeric scores, e.g. {score!r}: "
                             f"return one number (or None to skip) per response")
        values.append(None if math.isnan(value) else value)
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
    overlong_buffer: int = 0  # DAPO's soft overlong punishment: the last `buffer` of max_new_tokens cost up to penalty
    overlong_penalty: float = 1.0
    max_new_tokens: int = 0

    def apply(self, scores: torch.Tensor, ended: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) raw scores, whether each response ended, its length in tokens -> (B,) the scores PPO optimises."""
        if self.statistics is not None:
            mean, std = self.statistics
            scores = (scores - mean) / max(std, 1e-8)
        if self.clip is not None:
            scores = scores.clamp(-self.clip, self.clip)
        if self.missing_eos_penalty is not None:
            scores = scores + (~ended).float() * self.missing_eos_penalty
        if self.overlong_buffer > 0:
            # DAPO (Yu et al. 2025, verl's overlong_buffer): −penalty · (tokens past max − buffer) / buffer, at most 0
            exceed = lengths.float() - (self.max_new_tokens - self.overlong_buffer)
            scores = scores + (-exceed / self.overlong_buffer * self.overlong_penalty).clamp(max=0.0)
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
