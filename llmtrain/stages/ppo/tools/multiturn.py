"""The multi-turn rollout, on the hf engine or through vLLM: draw a turn, parse its tool calls, run them, append the
template's rendering of the results, draw again, until a turn calls no tool or ppo.max_tool_calling_iterations (TRL's
_tool_call_loop). One loop for every engine: the engine only draws a turn's tokens for a list of token lists (its
`turns` context, engines/__init__.py's TurnDraw: the lean sampler on the actor, or one request per trajectory to the
vLLM server with every token's weight version checked).

Token-exact: a trajectory is one token list grown by appending each turn's drawn tokens and each tool result's
suffix tokens; the history is never re-tokenised, so the tokens the update scores are the tokens drawn. Its layout is
the single-turn one (prompt left-padded to P, completion right-padded to A) with two differences: the attention mask
covers every completion token (the model's and the tool results', contiguous), and the action mask covers only the
model's own tokens, so the policy loss, the KL, the values and the advantages never train on tool or environment text.

Budgets: ppo.rollout.max_new_tokens bounds the whole completion (model and tool tokens, TRL's max_completion_length);
ppo.max_tokens_per_turn bounds one turn. A tool result that would leave no room for the next turn is dropped and the
trajectory ends (TRL's rule); every such end is counted.

Requested ahead (ppo.off_policy, vLLM): `submit` runs the whole loop in a background thread (with its own copy of the
tokenizer: the main thread's may be reconfigured meanwhile) and answers each finished trajectory as a JSON record
(what a checkpoint saves for a bitwise resume); `collect` lays the records out and counts the metrics (collectives).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from llmtrain.config import ConfigError
from llmtrain.distributed import all_reduce_max, all_reduce_sum
from llmtrain.stages.ppo import rollout as single_turn
from llmtrain.stages.ppo.engines import TurnDraw, left_padded
from llmtrain.stages.ppo.tools.executor import ToolStats, run_tool_calls
from llmtrain.stages.ppo.tools.loading import ENVIRONMENT_COLUMN, ENVIRONMENTS_KEYWORD, Environments, tool_methods
from llmtrain.stages.ppo.tools.parsing import parsed_turn, prompt_ids, tool_suffix_ids, with_response_parser


@dataclass(frozen=True)
class ToolSettings:
    timeout_s: float = 30.0  # ppo.tool_timeout_s
    max_iterations: int | None = None  # ppo.max_tool_calling_iterations; None: until a turn calls no tool
    max_tokens_per_turn: int | None = None  # ppo.max_tokens_per_turn; None: what is left of max_new_tokens


@dataclass
class Trajectory:
    messages: list[dict]  # the conversation so far (the prompt with reset's text, then turns and tool results)
    prompt: list[int]
    tools: list  # callables rendered in the prompt: the standalone tools and the environment's methods
    completion: list[int] = field(default_factory=list)  # every token after the prompt, in order
    own: list[bool] = field(default_factory=list)  # True on the model's own tokens
    logps: list[float] = field(default_factory=list)  # each token's sampled log-prob (0 on tool tokens)
    iterations: int = 0  # rounds of tool calls run
    text: str = ""  # the last turn's content: what reward functions and the exact match read
    ended: bool = False  # the last turn ended in a stop token
    done: bool = False
    stats: ToolStats = field(default_factory=ToolStats)
    outcome: str = ""  # answer | truncated | iterations | result_overlong
    malformed: int = 0  # turns with a `<tool_call>` opener the parser read no call from


OUTCOMES = ("truncated", "iterations", "result_overlong")
RECORDED = ("messages", "prompt", "completion", "own", "logps", "iterations", "text", "ended", "outcome", "malformed")


def record(t: Trajectory) -> dict:
    """A finished trajectory as JSON (its tools are the run's, not saved)."""
    return {**{name: getattr(t, name) for name in RECORDED}, "stats": vars(t.stats).copy()}


def from_record(saved: dict) -> Trajectory:
    return Trajectory(**{name: saved[name] for name in RECORDED}, tools=[], done=True,
                      stats=ToolStats(**saved["stats"]))


class MultiTurnEngine:
    """The inner engine's protocol (engines/__init__.py), with tools: start/sync/close are the inner engine's; with a
    vLLM inner engine also submit/collect (ppo.off_policy)."""

    def __init__(self, inner, tokenizer, tools: list, environments: Environments | None, settings: ToolSettings):
        self.inner, self.tokenizer = inner, with_response_parser(tokenizer)
        self.tools, self.environments, self.settings = list(tools), environments, settings
        self._background: MultiTurnEngine | None = None  # this engine with its own tokenizer, for `submit`

    @property
    def weight_version(self) -> str | None:
        return self.inner.weight_version

    def start(self, actor) -> None:
        self.inner.start(actor)

    def sync(self, actor, version: str) -> dict:
        return self.inner.sync(actor, version)

    def after_rollout(self) -> None:
        self.inner.after_rollout()

    def close(self) -> None:
        self.inner.close()

    def generate(self, actor, batch, settings, *, pad_token_id: int, eos_ids: list[int], seed: int,
                 group=None) -> single_turn.Rollout:
        prompts, columns = single_turn.repeated_rows(batch, settings.n_samples_per_prompt)
        trajectories, instances = self._start(prompts, columns)
        with self.inner.turns(actor, settings, pad_token_id=pad_token_id, eos_ids=eos_ids, seed=seed,
                              device=batch.input_ids.device) as (draw, gather_s):
            self._run(trajectories, draw, settings.max_new_tokens, eos_ids)
        if instances is not None:
            columns[ENVIRONMENTS_KEYWORD] = instances
        return self._rollout(trajectories, prompts, columns, batch, settings.n_samples_per_prompt, pad_token_id,
                             group, gather_s)

    def submit(self, actor, batch, settings, eos_ids: list[int], seed: int):
        """ppo.off_policy: the rollout's whole loop (server requests, tool calls) in the background; returns the
        inner engine's Requests at once, answered by the trajectories' records. Not a collective."""
        if self.environments is not None:  # validation refuses it (async_rollout.off_policy_problems)
            raise ConfigError("ppo.environment cannot be requested ahead (ppo.off_policy.max_staleness > 0)")
        prompts, columns = single_turn.repeated_rows(batch, settings.n_samples_per_prompt)
        draw = self.inner.turn_drawer(actor, settings, eos_ids, seed)
        if self._background is None:
            self._background = copy.copy(self)
            self._background.tokenizer = copy.deepcopy(self.tokenizer)
        background = self._background

        def work() -> list[dict]:
            trajectories, _ = background._start(prompts, columns)
            background._run(trajectories, draw, settings.max_new_tokens, eos_ids)
            return [record(t) for t in trajectories]

        return self.inner.submit_work(draw, work)

    def collect(self, actor, batch, requests, settings, *, pad_token_id: int, eos_ids: list[int],
                group=None) -> single_turn.Rollout:
        """The rollout of `requests` (sent by `submit` for `batch`, or restored from a checkpoint): a collective."""
        del actor, eos_ids
        prompts, columns = single_turn.repeated_rows(batch, settings.n_samples_per_prompt)
        records = requests.answers()[0]
        if len(records) != len(prompts):
            raise RuntimeError(f"multi-turn rollout in flight: {len(records)} trajectories answered for "
                               f"{len(prompts)} rows of its prompt batch (a resume on other data?)")
        trajectories = [from_record(saved) for saved in records]
        return self._rollout(trajectories, prompts, columns, batch, settings.n_samples_per_prompt, pad_token_id,
                             group, 0.0)

    @staticmethod
    def checkpointed(requests) -> list:
        return requests.answers()  # the trajectories' records, JSON already

    @staticmethod
    def _rollout(trajectories: list[Trajectory], prompts: list, columns: dict, batch, n: int, pad_token_id: int,
                 group, gather_s: float) -> single_turn.Rollout:
        out = laid_out(trajectories, pad_token_id, batch.input_ids.device, group)
        out.prompts = [t.messages[:len(p)] for t, p in zip(trajectories, prompts)]  # with reset's text, as TRL's
        out.columns, out.real, out.gather_s = columns, batch.real.repeat_interleave(n, 0), gather_s
        out.metrics = tool_metrics(trajectories, out, group)
        return out

    def _start(self, prompts: list, columns: dict) -> tuple[list[Trajectory], list | None]:
        """One trajectory per row: its environment drawn from the pool and reset with the row, its prompt rendered."""
        instances = None
        if self.environments is not None:
            instances = self.environments.draw(self.environments.names_of(columns, len(prompts)))
        trajectories = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, list):
                raise ConfigError("ppo.tools / ppo.environment render tools with the chat template: prompts must be "
                                  "messages (data.format=messages, or a prompt column of messages), got a string")
            messages, tools = [dict(m) for m in prompt], list(self.tools)
            if instances is not None:
                row = {"prompt": prompt, **{k: v[i] for k, v in columns.items()}}
                if self.environments.multiple:
                    row.pop(ENVIRONMENT_COLUMN, None)  # a control field, not passed to reset (TRL)
                observation = instances[i].reset(**row)
                if observation is not None:
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
                tools += [m for m in tool_methods(instances[i]) if m not in tools]
            trajectories.append(Trajectory(messages, prompt_ids(self.tokenizer, messages, tools), tools))
        return trajectories, instances

    def _run(self, trajectories: list[Trajectory], draw: TurnDraw, total: int, eos_ids: list[int]) -> None:
        """Turns until every trajectory is done: each draws every active trajectory's next turn, then runs its calls."""
        turn = 0
        while not all(t.done for t in trajectories):
            active = [i for i, t in enumerate(trajectories) if not t.done]
            budgets = [total - len(trajectories[i].completion) for i in active]
            if self.settings.max_tokens_per_turn:
                budgets = [min(b, self.settings.max_tokens_per_turn) for b in budgets]
            rows = [trajectories[i].prompt + trajectories[i].completion for i in active]
            for i, (tokens, logps) in zip(active, draw(rows, budgets, active, turn)):
                self._after_turn(trajectories[i], tokens, logps, eos_ids, total)
            turn += 1

    def _after_turn(self, t: Trajectory, tokens: list[int], logps: list[float], eos_ids: list[int],
                    total: int) -> None:
        prefix = t.prompt + t.completion
        t.completion += tokens
        t.own += [True] * len(tokens)
        t.logps += logps
        turn = parsed_turn(self.tokenizer, tokens, prefix, t.tools)
        t.text, t.ended = turn.get("content") or "", bool(tokens) and tokens[-1] in eos_ids
        calls = turn.get("tool_calls")
        if not calls and "<tool_call>" in t.text:
            t.malformed += 1
        if not t.ended:
            return self._finish(t, "truncated")
        if not calls:
            return self._finish(t, "answer")
        if self.settings.max_iterations is not None and t.iterations >= self.settings.max_iterations:
            return self._finish(t, "iterations")
        results, stats = run_tool_calls(calls, {f.__name__: f for f in t.tools}, self.settings.timeout_s)
        t.stats.add(stats)
        suffix = tool_suffix_ids(self.tokenizer, results, eos_ids)
        if len(t.completion) + len(suffix) >= total:  # no room left to answer: the results are dropped (TRL)
            return self._finish(t, "result_overlong")
        t.completion += suffix
        t.own += [False] * len(suffix)
        t.logps += [0.0] * len(suffix)
        t.messages += [turn, *results]
        t.iterations += 1

    @staticmethod
    def _finish(t: Trajectory, outcome: str) -> None:
        t.done, t.outcome = True, outcome


def laid_out(trajectories: list[Trajectory], pad_token_id: int, device, group) -> single_turn.Rollout:
    """The rollout layout: prompts left-padded to P and completions right-padded to A, both the widest on any rank;
    attention on every real token, the action mask on the model's own tokens only."""
    local = torch.tensor([max(len(t.prompt) for t in trajectories), max(max(len(t.completion) for t in trajectories),
                                                                         1)], device=device)
    prompt_width, num_actions = (int(v) for v in all_reduce_max(local, group).tolist())
    ids, prompt_mask = single_turn.left_pad(*left_padded([t.prompt for t in trajectories], pad_token_id, device),
                                             prompt_width, pad_token_id)

    def right(values: list, fill) -> list:
        return values + [fill] * (num_actions - len(values))

    completions = torch.tensor([right(t.completion, pad_token_id) for t in trajectories], device=device)  # (B, A)
    attention = torch.tensor([right([1] * len(t.completion), 0) for t in trajectories], device=device)  # (B, A)
    own = torch.tensor([right(t.own, False) for t in trajectories], dtype=torch.bool, device=device)  # (B, A)
    logps = torch.tensor([right(t.logps, 0.0) for t in trajectories], dtype=torch.float32, device=device)
    return single_turn.Rollout(
        sequences=torch.cat([ids, completions], 1), attention_mask=torch.cat([prompt_mask, attention], 1),
        action_mask=own, ended=torch.tensor([t.ended for t in trajectories], device=device), prompts=[], columns={},
        real=torch.ones(len(trajectories), dtype=torch.bool, device=device), engine_logps=logps,
        texts=[t.text for t in trajectories])


def tool_metrics(trajectories: list[Trajectory], rollout: single_turn.Rollout, group) -> dict:
    """TRL's tools_call_frequency (calls per trajectory) and tools_failure_frequency (failures per call), and the
    share of trajectories that called a tool, with every counted outcome; over every dp rank."""
    counts = [len(trajectories), sum(t.stats.calls for t in trajectories), sum(t.stats.failures for t in trajectories),
              sum(t.stats.timeouts for t in trajectories), sum(t.stats.calls > 0 for t in trajectories),
              sum(t.malformed for t in trajectories),
              int((rollout.attention_mask[:, -rollout.num_actions:].bool() & ~rollout.action_mask).sum()),
              *(sum(t.outcome == outcome for t in trajectories) for outcome in OUTCOMES)]
    total = all_reduce_sum(torch.tensor(counts, dtype=torch.float64, device=rollout.sequences.device), group).tolist()
    rows, calls, failures, timeouts, calling, malformed, tool_tokens, *outcomes = total
    return {"tools_call_frequency": calls / max(rows, 1), "tools_failure_frequency": failures / max(calls, 1),
            "tools_share": calling / max(rows, 1), "tools_timeouts": timeouts, "tools_malformed": malformed,
            "tools_result_tokens": tool_tokens / max(rows, 1),
            **{f"tools_{outcome}": count for outcome, count in zip(OUTCOMES, outcomes)}}
