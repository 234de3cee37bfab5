"""The `preference` format: a chosen and a rejected sequence sharing a loss-free prompt (`encode_preference`)."""

from typing import NamedTuple

from llmtrain.data.errors import DataConfigError
from llmtrain.data.format_spec import DataFormat
from llmtrain.data.outcomes import DROPPED_EMPTY, DROPPED_IDENTICAL, DROPPED_OVERLONG, KEPT, TRUNCATED
from llmtrain.data.synthetic import reversal_preferences
from llmtrain.data.tokens import bos_ids, chat_ids, eos_ids, text_ids, turn_span
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.stop_tokens import special_token_ids


class PairParts(NamedTuple):
    """A preference pair before fitting: both sides are head + prompt + their response."""

    head: list[int]  # kept whole when the prompt is cut: the bos (or nothing)
    prompt: list[int]  # loss-free context shared by both sides; cut from the left when too long
    chosen: list[int]  # response tokens, ending in eos
    rejected: list[int]


def encode_preference(row: dict, tokenizer, max_seq_len: int | None = None, overlong: str = "truncate") -> dict:
    """A chosen and a rejected sequence sharing a loss-free prompt; both end in their stop token (the scored one):
    eos for text, the chat template's end of turn for conversations.

    Rows are `prompt` + `chosen` + `rejected` strings; chat messages lists for chosen and rejected
    (after an optional `prompt` list of messages, TRL's conversational layout; see `_chat_pair`), whose
    messages before the final assistant reply are the prompt; or whole `chosen` and `rejected` texts
    without a prompt, every token after bos a target. Over-long pairs lose the start of the prompt
    (`truncate`, as TRL's keep_end; responses are never cut) or are dropped (`drop`); identical or
    empty pairs are dropped. `margin` (0.0 when absent) and `kind` ("" when absent) are carried through.
    """
    prompt, chosen, rejected = row.get("prompt"), row.get("chosen"), row.get("rejected")
    margin = 0.0 if row.get("margin") is None else float(row["margin"])
    kind = "" if row.get("kind") is None else str(row["kind"])
    if chosen is None or rejected is None:  # a null cell (parquet, or a key missing from a json row)
        return _dropped_pair(DROPPED_EMPTY, margin, kind)
    if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, (str, type(None))):
        if not chosen.strip() or not rejected.strip():
            return _dropped_pair(DROPPED_EMPTY, margin, kind)
        parts = _text_pair(prompt or "", chosen, rejected, tokenizer)
    elif isinstance(chosen, list) and isinstance(rejected, list) and isinstance(prompt, (list, str, type(None))):
        if _final_reply(chosen) is None or _final_reply(rejected) is None:
            return _dropped_pair(DROPPED_EMPTY, margin, kind)
        parts = _chat_pair(prompt, chosen, rejected, tokenizer)
    else:
        raise DataConfigError(
            f"data.format=preference: a row mixes shapes (prompt {type(prompt).__name__}, chosen "
            f"{type(chosen).__name__}, rejected {type(rejected).__name__}); give chosen and rejected both as "
            f"strings (with an optional string prompt) or both as lists of messages (with an optional "
            f"prompt list of messages)")
    if parts.chosen == parts.rejected:
        return _dropped_pair(DROPPED_IDENTICAL, margin, kind)
    fitted = _fit_pair(parts, max_seq_len, overlong)
    if fitted is None:
        return _dropped_pair(DROPPED_OVERLONG, margin, kind)
    parts, outcome = fitted
    context = parts.head + parts.prompt
    loss_free = [IGNORE_INDEX] * len(context)
    return {"chosen_input_ids": context + parts.chosen, "chosen_labels": loss_free + parts.chosen,
            "rejected_input_ids": context + parts.rejected, "rejected_labels": loss_free + parts.rejected,
            "margin": margin, "kind": kind, "outcome": outcome}


def _text_pair(prompt: str, chosen: str, rejected: str, tokenizer) -> PairParts:
    eos = eos_ids(tokenizer)
    return PairParts(bos_ids(tokenizer), text_ids(tokenizer, prompt) if prompt else [],
                     text_ids(tokenizer, chosen) + eos, text_ids(tokenizer, rejected) + eos)


def _final_reply(side: list[dict]) -> dict | None:
    """The scored reply of a side (its last message, from the assistant), or None when it has none.

    A side with no assistant message, or whose last reply is blank, is empty. A side whose last
    message comes after an assistant reply cannot be scored at that reply: an error, not a drop.
    """
    if not any(message["role"] == "assistant" for message in side):
        return None
    last = side[-1]
    if last["role"] != "assistant":
        raise DataConfigError(
            f"data.format=preference: a chosen/rejected conversation ends with a {last['role']!r} message "
            f"after the assistant's reply; the reply compared must be the last message of each side")
    content = last.get("content")
    blank = not content or (isinstance(content, str) and not content.strip())
    return None if blank else last


def _chat_pair(prompt: list[dict] | str | None, chosen: list[dict], rejected: list[dict], tokenizer) -> PairParts:
    """Both conversations rendered by the chat template; everything before the final reply is the prompt.

    A list `prompt` opens both conversations (TRL's conversational layout). A string `prompt` beside
    conversations repeats their user message (UltraFeedback's layout): it is checked, not rendered.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataConfigError("data.format=preference with messages lists needs a chat template, but "
                              "model.tokenizer has none; use a tokenizer that ships one, or give strings")
    opening = list(prompt) if isinstance(prompt, list) else []
    conversations = {"chosen": opening + list(chosen), "rejected": opening + list(rejected)}
    context = conversations["chosen"][:-1]
    if conversations["rejected"][:-1] != context:
        raise DataConfigError(f"data.format=preference: {_first_difference(conversations)}; the chosen and "
                              f"rejected conversations must share every message before their final "
                              f"assistant reply (the prompt) and differ only in that reply")
    if not context:
        raise DataConfigError("data.format=preference: a conversation is a lone assistant message; "
                              "transformers cannot render the empty context before it, so put the prompt "
                              "before it as messages (in chosen and rejected, or as a `prompt` list of messages)")
    if isinstance(prompt, str) and prompt.strip() and not any(
            isinstance(m.get("content"), str) and m["content"].strip() == prompt.strip() for m in context):
        raise DataConfigError(f"data.format=preference: the string prompt {_short(prompt)} is not a message of "
                              f"the chosen/rejected conversations; beside messages lists a string prompt is "
                              f"not rendered, so give it as a `prompt` list of messages instead")
    before = chat_ids(tokenizer, context, add_generation_prompt=True)
    special_ids, eos = special_token_ids(tokenizer), eos_ids(tokenizer)
    responses = {}
    for side, messages in conversations.items():
        through = chat_ids(tokenizer, messages, add_generation_prompt=False)
        if through[: len(before)] != before:
            raise DataConfigError(
                f"data.format=preference: the chat template of model.tokenizer does not render the {side} "
                f"conversation incrementally (its messages before the final reply, with "
                f"add_generation_prompt=True, are not a token prefix of the whole), so the reply cannot be "
                f"located; use a template that renders each turn on its own, or give strings")
        turn = turn_span(len(before), through, special_ids)
        response = through[turn.start : turn.end]  # through the end-of-turn token; formatting after it goes
        # A reply ends at the template's end of turn, where SFT taught it to stop and rollouts stop: the token a
        # reward model scores. Only a template that prints no special token after the reply gets eos.
        responses[side] = response if response[-1:] and response[-1] in special_ids else response + eos
    head = before[:1] if before[:1] == bos_ids(tokenizer) else []
    return PairParts(head, before[len(head):], responses["chosen"], responses["rejected"])


def _first_difference(conversations: dict[str, list[dict]]) -> str:
    chosen, rejected = (conversations[side][:-1] for side in ("chosen", "rejected"))
    if len(chosen) != len(rejected):
        return f"chosen has {len(chosen)} messages before its final reply, rejected {len(rejected)}"
    i = next(i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b)
    return f"message {i} differs: chosen {_short(chosen[i])} vs rejected {_short(rejected[i])}"


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fit_pair(parts: PairParts, max_seq_len: int | None, overlong: str):
    """(parts, outcome) within max_seq_len, or None when the pair is dropped.

    Only the prompt is cut, from the left (its end, next to the reply, matters most), and by the same
    tokens on both sides, so chosen and rejected keep sharing it; the head (bos) stays.
    """
    longer = max(len(parts.chosen), len(parts.rejected))
    if max_seq_len is None or len(parts.head) + len(parts.prompt) + longer <= max_seq_len:
        return parts, KEPT
    room = max_seq_len - len(parts.head) - longer  # prompt tokens that fit
    if overlong == "drop" or room < 0:  # a response that alone overflows is never cut: dropped
        return None
    return parts._replace(prompt=parts.prompt[len(parts.prompt) - room:]), TRUNCATED


def _dropped_pair(outcome: str, margin: float = 0.0, kind: str = "") -> dict:
    return {"chosen_input_ids": [], "chosen_labels": [], "rejected_input_ids": [], "rejected_labels": [],
            "margin": margin, "kind": kind, "outcome": outcome}


DATA_FORMATS = (DataFormat("preference", columns=(("chosen",), ("rejected",)), encode=encode_preference,
                           optional=("prompt", "margin", "kind"), example="pair", synthetic=reversal_preferences),)
