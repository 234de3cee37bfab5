"""The multi-turn rollout on the hf engine: generate, parse the turn's tool calls, run them, append the template's
rendering of the results, generate again, until a turn calls no tool or ppo.max_tool_calling_iterations (TRL's
_tool_call_loop, on our lean sampler).

Token-exact: a trajectory is one token list grown by appending each turn's drawn tokens and each tool result's
suffix tokens; the history is never re-tokenised, so the tokens the update scores are the tokens drawn. Its layout is
the single-turn one (prompt left-padded to P, completion right-padded to A) with two differences: the attention mask
covers every completion token (the model's and the tool results', contiguous), and the action mask covers only the
model's own tokens, so the policy loss, the KL, the values and the advantages never train on tool or environment text.

Budgets: ppo.rollout.max_new_tokens bounds the whole completion (model and tool tokens, TRL's max_completion_length);
ppo.max_tokens_per_turn bounds one turn. A tool result that would leave no room for the next turn is dropped and the
trajectory ends (TRL's rule); every such end is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from llmtrain.config import ConfigError
from llmtrain.distributed import all_reduce_max, all_reduce_sum
from llmtrain.stages.ppo import rollout as single_turn
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


class MultiTurnEngine:
    """The hf engine's protocol (engines/__init__.py), with tools: start/sync/close are the inner engine's."""

    def __init__(self, inner, tokenizer, tools: list, environments: Environments | None, settings: ToolSettings):
        self.inner, self.tokenizer = inner, with_response_parser(tokenizer)
        self.tools, self.environments, self.settings = list(tools), environments, settings

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
        n = settings.n_samples_per_prompt
        prompts = [p for p in batch.prompts for _ in range(n)]
        columns = {k: [v for v in values for _ in range(n)] for k, values in batch.columns.items()}
        trajectories, instances = self._start(prompts, columns)
        with single_turn.sampling_model(actor, seed, batch.input_ids.device) as (model, gather_s):
            while not all(t.done for t in trajectories):
                self._turn(model, [t for t in trajectories if not t.done], settings, pad_token_id, eos_ids,
                           batch.input_ids.device)
        if instances is not None:
            columns[ENVIRONMENTS_KEYWORD] = instances
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

    def _turn(self, model, active: list[Trajectory], settings, pad_token_id: int, eos_ids: list[int],
              device) -> None:
        """One model turn for every active trajectory, then its tool calls."""
        total = settings.max_new_tokens
        budgets = [total - len(t.completion) for t in active]
        if self.settings.max_tokens_per_turn:
            budgets = [min(b, self.settings.max_tokens_per_turn) for b in budgets]
        draw = single_turn.drawer(model, replace(settings, max_new_tokens=max(budgets)), pad_token_id, eos_ids)
        size = settings.batch_size or len(active)
        stop = torch.tensor(eos_ids)
        for lo in range(0, len(active), size):
            chunk = active[lo:lo + size]
            ids, mask = left_padded([t.prompt + t.completion for t in chunk], pad_token_id, device)
            out, logps = draw(ids, mask)  # (b, width + a), (b, a)
            drawn = out[:, ids.shape[1]:].cpu()
            keep = single_turn.up_to_first_eos(drawn, stop)  # (b, a): through the first stop token
            for t, row, row_keep, row_logps, budget in zip(chunk, drawn, keep, logps.float().cpu(), budgets[lo:]):
                tokens = row[row_keep][:budget].tolist()
                self._after_turn(t, tokens, row_logps[:len(tokens)].tolist(), eos_ids, total)

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


def left_padded(rows: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (b, W) ids left-padded with pad, (b, W) mask."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


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
