"""Token ids a tokenizer gives for text, chat and its special tokens, and where an assistant reply ends: the pieces
every format's encoder (llmtrain/data/formats.py, preference_format.py) and the prompt loader share."""

from typing import NamedTuple


class AssistantTurn(NamedTuple):
    start: int  # first target token
    marker: int  # index of the end-of-turn token (== end when the template has none)
    end: int  # one past the last target token


def turn_span(start: int, through: list[int], special_ids: set[int]) -> AssistantTurn:
    # Targets run through the last special token of the reply (e.g. <|end|>, <|eot_id|>, </s>): the
    # token generation stops at. Template text after it (a newline) is formatting, not the reply.
    markers = [t for t in range(start, len(through)) if through[t] in special_ids]
    if not markers:
        return AssistantTurn(start, len(through), len(through))
    return AssistantTurn(start, markers[-1], markers[-1] + 1)


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> list[int]:
    """The chat template's tokens; `tools` (JSON schemas or functions) rendered as the template renders them (`or
    None`, as TRL: some templates render tool boilerplate for an empty list)."""
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    # transformers 5 returns a BatchEncoding here; older versions a plain list
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def text_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def bos_ids(tokenizer) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def eos_ids(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
