"""The lookup task (llmtrain/tasks/lookup.py): the tool reads the table and refuses what is not a key, the reward is
the exact match of the final answer, and the shipped data is what the seeded generator writes, held-out keys apart."""

from __future__ import annotations

import json

from llmtrain.paths import ASSETS_DIR
from llmtrain.stages.ppo.tools.executor import run_tool_calls
from llmtrain.tasks import lookup as task


def shipped(name: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS_DIR / "data" / name).read_text().splitlines()]


def call(key) -> dict:
    return {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}


def test_the_tool_answers_a_keys_code_and_an_error_for_anything_else():
    results, stats = run_tool_calls([call("abcd"), call("ABCD"), call("abc")], {"lookup": task.lookup}, timeout_s=5)
    assert results[0] == {"role": "tool", "name": "lookup", "content": task.code_of("abcd")}
    assert len(task.code_of("abcd")) == 5 and task.code_of("abcd").isalpha()
    assert task.code_of("abcd") != task.code_of("abce")  # a table, not a rule on the letters
    assert all("no key" in r["content"] for r in results[1:]) and (stats.calls, stats.failures) == (3, 2)


def test_score_is_the_exact_match_of_the_final_answer():
    assert task.score(["p"] * 4, ["vwxyz", " vwxyz\n", "vwxy", "VWXYZ"], ["vwxyz"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_shipped_data_is_the_generators_and_held_out_keys_never_train():
    train, held_out = shipped("lookup_train.jsonl"), shipped("lookup_eval.jsonl")
    eval_keys = task.draw_keys(task.EVAL_KEYS, seed=12)
    train_keys = task.draw_keys(task.TRAIN_KEYS, seed=11, exclude=set(eval_keys))
    assert held_out == task.prompt_rows(eval_keys) and train == task.prompt_rows(train_keys)
    assert shipped("lookup_traces_eval.jsonl") == task.trace_rows(eval_keys)
    assert shipped("lookup_traces_train.jsonl")[:50] == task.trace_rows(train_keys[:50])
    assert not set(eval_keys) & set(train_keys)
    assert all(row["response"] == task.code_of(row["prompt"][0]["content"].split()[-1]) for row in held_out)


def test_the_tool_schema_stays_short():
    """Every byte of it is a token of every prompt (the byte-level tiny tokenizer)."""
    assert len(task.tool_schemas()) <= 220, task.tool_schemas()  # 213 bytes today
