"""Running the tool calls a model made, with TRL 1.16's conventions (GRPOTrainer._tool_call_loop) plus a timeout.

- A call names a function among the rollout's tools (sync or async); its parsed `arguments` are passed by keyword.
- A tool that raises, an unknown tool, or a call that is not `{"type": "function"}` becomes the result
  `{"error": str(e)}`, counted as a failure; a result that is not text is converted with `str()` (as TRL does).
- llmtrain adds `ppo.tool_timeout_s`, which TRL lacks: a call still running after it becomes
  `{"error": "... timed out ..."}`, counted as a failure and a timeout. The call runs in a daemon thread: a tool that
  hangs forever is left behind (Python cannot kill a thread) and never blocks the rollout or the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ToolStats:
    calls: int = 0
    failures: int = 0  # raised, unknown tool, unsupported call type, or timed out
    timeouts: int = 0

    def add(self, other: ToolStats) -> None:
        self.calls += other.calls
        self.failures += other.failures
        self.timeouts += other.timeouts


class ToolTimeout(Exception):
    pass


def call_with_timeout(function: Callable, arguments: dict, timeout_s: float):
    """function(**arguments) (awaited when async) in a daemon thread; its result, or its exception re-raised, or
    ToolTimeout after `timeout_s` seconds."""
    box: dict = {}

    def run() -> None:
        try:
            result = function(**arguments)
            box["result"] = asyncio.run(result) if inspect.isawaitable(result) else result
        except BaseException as error:  # noqa: BLE001 -- any failure of user code is the tool's result
            box["error"] = error

    thread = threading.Thread(target=run, name=f"tool-{getattr(function, '__name__', 'call')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ToolTimeout(f"tool {getattr(function, '__name__', function)!r} timed out after {timeout_s:g} s "
                          "(ppo.tool_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def run_tool_calls(tool_calls: list[dict], tools: dict[str, Callable],
                   timeout_s: float) -> tuple[list[dict], ToolStats]:
    """A turn's parsed tool calls -> (one tool message per call, in order: {"role": "tool", "name", "content"};
    the turn's counts)."""
    stats, messages = ToolStats(), []
    for call in tool_calls:
        stats.calls += 1
        if call.get("type") != "function":
            stats.failures += 1
            name = call.get("name", "unknown")
            result = {"error": f"Unsupported tool call type: {call.get('type')}"}
        else:
            name = call["function"]["name"]
            try:
                if name not in tools:
                    raise ValueError(f"Tool {name} not found.")
                result = call_with_timeout(tools[name], dict(call["function"].get("arguments") or {}), timeout_s)
            except Exception as error:  # noqa: BLE001 -- TRL: the error is the tool's answer
                stats.failures += 1
                stats.timeouts += isinstance(error, ToolTimeout)
                result = {"error": str(error)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages, stats
