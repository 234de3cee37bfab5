"""The lookup task, where the tool matters: every key (four letters) has a code (five letters) in a table only the tool
reads, so a model answers a held-out key's code only by calling `lookup` and copying its result. Keys and codes are
lowercase, as the reversal task's words: a model that learned to copy those (sft_tiny) learns the task in ~140 steps,
where capital-letter codes (letters that base never saw) were still not copied after 300.

- `lookup(key)`: the tool, as TRL takes tools (type hints and a Google-style docstring). Its schema is short on
  purpose: with the byte-level tiny tokenizer every byte of it is a token of every prompt.
- `score(prompts, responses, response)`: 1 for the exact code as the final answer, else 0.
- The data (llmtrain/assets/data): tool-call traces for SFT (`messages`: the question, the call, the tool's result,
  the answer; and a `tools` column, the tools' JSON schemas as a JSON string, as TRL's SFTTrainer reads it) and prompts
  with their reference code for GRPO (`prompt` messages, `response`). Held-out keys never appear in training.
  Regenerate with `python -m llmtrain.tasks.lookup` (seeded: the same files every time).
"""

from __future__ import annotations

import hashlib
import json
import random
import string

from llmtrain.data.synthetic import ASSET_DATA_DIR, write_jsonl

KEY_LEN, CODE_LEN = 4, 5
TABLE_SALT = b"llmtrain-lookup-v1"  # the table is a keyed hash: no rule a model could learn from the training keys
TRAIN_KEYS, EVAL_KEYS = 2000, 256


def is_key(key: str) -> bool:
    return len(key) == KEY_LEN and all(c in string.ascii_lowercase for c in key)


def code_of(key: str) -> str:
    digest = hashlib.sha256(TABLE_SALT + key.encode()).digest()
    return "".join(string.ascii_lowercase[b % 26] for b in digest[:CODE_LEN])


def lookup(key: str):  # no return annotation: it would add `"return": {...}` to every prompt's schema
    """The code of a key.

    Args:
        key: a key
    """
    if not isinstance(key, str) or not is_key(key):
        raise ValueError(f"no key {key!r} in the table")
    return code_of(key)


def score(prompts: list, responses: list[str], response: list[str], **_) -> list[float]:
    """1.0 where the final answer is the reference code (surrounding spaces aside), else 0.0."""
    return [float(str(r).strip() == str(t).strip()) for r, t in zip(responses, response)]


def question(key: str) -> list[dict]:
    return [{"role": "user", "content": f"code of {key}"}]


def trace(key: str) -> list[dict]:
    """The conversation a model that uses the tool has: the question, the call, the result, the answer."""
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
    return [*question(key), {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "lookup", "content": code_of(key)}, {"role": "assistant", "content": code_of(key)}]


def tool_schemas() -> str:
    """The `tools` column: what transformers renders for ppo.tools=[llmtrain.tasks.lookup:lookup], as JSON."""
    from transformers.utils import get_json_schema

    return json.dumps([get_json_schema(lookup)])


def draw_keys(n: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """n distinct keys, none in `exclude`, in a seeded order."""
    rng, keys = random.Random(seed), []
    seen = set(exclude)
    while len(keys) < n:
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(KEY_LEN))
        if key not in seen:
            seen.add(key)
            keys.append(key)
    return keys


def trace_rows(keys: list[str]) -> list[dict]:
    tools = tool_schemas()
    return [{"messages": trace(key), "tools": tools} for key in keys]


def prompt_rows(keys: list[str]) -> list[dict]:
    return [{"prompt": question(key), "response": code_of(key)} for key in keys]


def main() -> None:
    eval_keys = draw_keys(EVAL_KEYS, seed=12)
    train_keys = draw_keys(TRAIN_KEYS, seed=11, exclude=set(eval_keys))
    write_jsonl(ASSET_DATA_DIR / "lookup_traces_train.jsonl", trace_rows(train_keys))
    write_jsonl(ASSET_DATA_DIR / "lookup_traces_eval.jsonl", trace_rows(eval_keys))
    write_jsonl(ASSET_DATA_DIR / "lookup_train.jsonl", prompt_rows(train_keys))
    write_jsonl(ASSET_DATA_DIR / "lookup_eval.jsonl", prompt_rows(eval_keys))
    print(f"wrote lookup_traces_{{train,eval}}.jsonl and lookup_{{train,eval}}.jsonl to {ASSET_DATA_DIR}")


if __name__ == "__main__":
    main()
