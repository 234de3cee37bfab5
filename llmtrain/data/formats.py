"""Rows -> `input_ids` with aligned `labels` (IGNORE_INDEX where no loss), one encoder per format.

Every encoder returns {"input_ids", "labels", "outcome"}; `outcome` says whether the sample was
kept as is, truncated, chunked, or dropped, so the counts in `DataStats` come from the same code that acts.
Target tokens are counted the way the loss counts them: labels[1:] (label 0 is never predicted).
The `preference` encoder returns a pair instead: `chosen_*` and `rejected_*` ids and labels (see
`encode_preference`), with the same `outcome`.
"""

from dataclasses import asdict, dataclass
from typing import NamedTuple

from llmtrain.data import PREFERENCE_FORMATS
from llmtrain.data.errors import DataConfigError
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.stop_tokens import special_token_ids

KEPT, TRUNCATED = "kept", "truncated"
CHUNKED, NEXT_CHUNK = "chunked", "next_chunk"  # a text split into rows: its first row, each further row
DROPPED_OVERLONG, DROPPED_NO_TARGET = "dropped_overlong", "dropped_no_target"
DROPPED_IDENTICAL, DROPPED_EMPTY = "dropped_identical", "dropped_empty"  # preference pairs only
OVERLONG_POLICIES = ("truncate", "drop", "chunk")
TRAINED = (KEPT, TRUNCATED, CHUNKED, NEXT_CHUNK)

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"

# Per format: the columns it needs; each entry lists the accepted names for one column.
REQUIRED_COLUMNS = {
    "text": [("text",)],
    "prompt_response": [("prompt",), ("response", "completion")],
    "alpaca": [("instruction",), ("output",)],  # `input` is optional
    "messages": [("messages",)],
    "preference": [("chosen",), ("rejected",)],  # `prompt`, `margin` and `kind` are optional
}


@dataclass
class DataStats:
    samples_in: int = 0
    samples_out: int = 0  # rows trained on: a chunked text gives several
    truncated: int = 0
    chunked: int = 0
    dropped_overlong: int = 0
    dropped_no_target: int = 0
    dropped_identical: int = 0  # preference pairs whose two sides encode to the same tokens
    dropped_empty: int = 0  # preference pairs with an empty side
    tokens: int = 0  # preference pairs: the tokens of both sides
    target_tokens: int = 0

    @classmethod
    def from_outcomes(cls, outcomes: list[str], lengths: list[int], targets: list[int]) -> "DataStats":
        kept = [i for i, outcome in enumerate(outcomes) if outcome in TRAINED]
        return cls(
            samples_in=len(outcomes) - outcomes.count(NEXT_CHUNK),
            samples_out=len(kept),
            truncated=outcomes.count(TRUNCATED),
            chunked=outcomes.count(CHUNKED),
            dropped_overlong=outcomes.count(DROPPED_OVERLONG),
            dropped_no_target=outcomes.count(DROPPED_NO_TARGET),
            dropped_identical=outcomes.count(DROPPED_IDENTICAL),
            dropped_empty=outcomes.count(DROPPED_EMPTY),
            tokens=sum(lengths[i] for i in kept),
            target_tokens=sum(targets[i] for i in kept),
        )

    def summary(self) -> str:
        return " ".join(f"{name}={value}" for name, value in asdict(self).items())


class AssistantTurn(NamedTuple):
    start: int  # first target token
    marker: int  # index of the end-of-turn token (== end when the template has none)
    end: int  # one past the last target token


def check_columns(column_names: list[str], fmt: str) -> None:
    if fmt not in REQUIRED_COLUMNS:
        raise DataConfigError(f"data.format={fmt!r} is unknown; choose one of {sorted(REQUIRED_COLUMNS)}")
    for accepted in REQUIRED_COLUMNS[fmt]:
        if not any(name in column_names for name in accepted):
            raise DataConfigError(
                f"data.format={fmt} needs a column {' or '.join(repr(n) for n in accepted)}, but the data "
                f"has columns {sorted(column_names)}; rename the column or set data.format to match the data"
            )


def check_tokenizer(tokenizer, fmt: str) -> None:
    if fmt == "messages" and getattr(tokenizer, "chat_template", None) is None:
        raise DataConfigError("data.format=messages needs a chat template, but model.tokenizer has none; "
                              "use a tokenizer that ships one, or set data.format to prompt_response")
    if fmt in ("prompt_response", "alpaca") and tokenizer.eos_token_id is None:
        raise DataConfigError(f"data.format={fmt} appends an eos token so the model learns to stop, but "
                              "model.tokenizer has no eos_token; use a tokenizer that defines one")
    if fmt in PREFERENCE_FORMATS and tokenizer.eos_token_id is None:
        raise DataConfigError(f"data.format={fmt} ends every sequence in an eos token (a reward model scores "
                              "the last token), but model.tokenizer has no eos_token; use one that defines it")


def check_length_policy(max_seq_len: int, overlong: str, fmt: str = "text") -> None:
    if overlong not in OVERLONG_POLICIES:
        raise DataConfigError(f"data.overlong={overlong!r} is unknown; choose one of {OVERLONG_POLICIES}")
    if overlong == "chunk" and fmt != "text":
        raise DataConfigError(f"data.overlong=chunk splits plain text into rows; a {fmt} sample cut in two "
                              f"loses its prompt or response: use data.overlong=truncate or drop")
    if max_seq_len < 2:
        raise DataConfigError(f"data.max_seq_len={max_seq_len} leaves nothing to predict; use 2 or more")


def count_targets(labels: list[int]) -> int:
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def encode_row(row: dict, tokenizer, fmt: str, max_seq_len: int | None, overlong: str) -> dict:
    """The format's encoding, with samples left without a target token marked as dropped."""
    encoded = FORMATS[fmt](row, tokenizer, max_seq_len, overlong)
    if fmt in PREFERENCE_FORMATS:  # a kept side always has targets: its response (never cut) and eos
        return encoded
    if encoded["outcome"] != DROPPED_OVERLONG and count_targets(encoded["labels"]) == 0:
        return _dropped(DROPPED_NO_TARGET)
    return encoded


def encode_text(row: dict, tokenizer, max_seq_len: int | None = None, overlong: str = "truncate") -> dict:
    """Every token a target. Over-long with `chunk`: the whole text, marked CHUNKED (see `split_chunks`)."""
    ids = _bos(tokenizer) + _token_ids(tokenizer, row["text"]) + _eos(tokenizer)
    outcome = KEPT
    if max_seq_len is not None and len(ids) > max_seq_len:
        if overlong == "drop":
            return _dropped(DROPPED_OVERLONG)
        if overlong == "chunk":
            return {"input_ids": ids, "labels": list(ids), "outcome": CHUNKED}
        ids, outcome = ids[:max_seq_len], TRUNCATED
    return {"input_ids": ids, "labels": list(ids), "outcome": outcome}


def split_chunks(encoded: dict, max_seq_len: int) -> list[dict]:
    """A CHUNKED text as rows of max_seq_len tokens (the last one shorter).

    Each row is a sample of its own: its first token is not predicted from the previous row (unpacked,
    label 0 never is; packed, `merge_packed` masks it). A last row of one token holds no target: left out.
    """
    ids = encoded["input_ids"]
    starts = [start for start in range(0, len(ids), max_seq_len) if len(ids) - start > 1]
    return [{"input_ids": ids[start:start + max_seq_len], "labels": ids[start:start + max_seq_len],
             "outcome": CHUNKED if start == 0 else NEXT_CHUNK} for start in starts]


def encode_prompt_response(
    row: dict, tokenizer, max_seq_len: int | None = None, overlong: str = "truncate"
) -> dict:
    response = row["response"] if "response" in row else row["completion"]
    return _encode_prompt_and_response(row["prompt"], response, tokenizer, max_seq_len, overlong)


def encode_alpaca(row: dict, tokenizer, max_seq_len: int | None = None, overlong: str = "truncate") -> dict:
    prompt = alpaca_prompt(row["instruction"], row.get("input") or "")
    return _encode_prompt_and_response(prompt, row["output"], tokenizer, max_seq_len, overlong)


def alpaca_prompt(instruction: str, input_text: str) -> str:
    if input_text.strip():
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT.format(instruction=instruction)


def _encode_prompt_and_response(prompt: str, response: str, tokenizer, max_seq_len, overlong) -> dict:
    prompt_ids = _bos(tokenizer) + _token_ids(tokenizer, prompt)
    response_ids = _token_ids(tokenizer, response)
    eos = _eos(tokenizer)
    outcome = KEPT
    if max_seq_len is not None and len(prompt_ids) + len(response_ids) + len(eos) > max_seq_len:
        room = max_seq_len - len(prompt_ids) - len(eos)  # response tokens that fit before the eos
        # A prompt that leaves no room for one response token is dropped, never cut from the left:
        # its start usually holds the instruction that the response answers.
        if overlong == "drop" or room < 1:
            return _dropped(DROPPED_OVERLONG)
        response_ids, outcome = response_ids[:room], TRUNCATED
    ids = prompt_ids + response_ids + eos
    labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids + eos
    return {"input_ids": ids, "labels": labels, "outcome": outcome}


def encode_messages(row: dict, tokenizer, max_seq_len: int | None = None, overlong: str = "truncate") -> dict:
    """Chat rendered by the tokenizer's template; only assistant turns (through end-of-turn) are targets.

    The template owns the special tokens (a bos included), so none are added here.
    """
    messages = row["messages"]
    ids = _chat_ids(tokenizer, messages, add_generation_prompt=False)
    turns = _assistant_turns(tokenizer, messages, ids)
    fitted = _fit_conversation(ids, turns, max_seq_len, overlong)
    if fitted is None:
        return _dropped(DROPPED_OVERLONG)
    ids, turns, outcome = fitted
    labels = [IGNORE_INDEX] * len(ids)
    for turn in turns:
        labels[turn.start : turn.end] = ids[turn.start : turn.end]
    return {"input_ids": ids, "labels": labels, "outcome": outcome}


def _assistant_turns(tokenizer, messages: list[dict], full_ids: list[int]) -> list[AssistantTurn]:
    """Token span of each assistant reply, found by rendering the conversation up to it."""
    special_ids = special_token_ids(tokenizer)
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise DataConfigError("data.format=messages: a conversation starts with an assistant message; "
                                  "transformers cannot render the empty context before it, so its loss "
                                  "span is unknown; start every conversation with a system or user message")
        before = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
        through = _chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if through[: len(before)] != before or full_ids[: len(through)] != through:
            raise DataConfigError(
                f"data.format=messages: the chat template of model.tokenizer does not render turns "
                f"incrementally (messages[:{i}] with add_generation_prompt=True is not a token prefix of "
                f"messages[:{i + 1}], or that is not a prefix of the whole conversation), so assistant "
                f"tokens cannot be located; use a template that renders each turn on its own, or "
                f"convert the data to data.format=prompt_response"
            )
        turns.append(_turn_span(len(before), through, special_ids))
    return turns


def _turn_span(start: int, through: list[int], special_ids: set[int]) -> AssistantTurn:
    # Targets run through the last special token of the reply (e.g. <|end|>, <|eot_id|>, </s>): the
    # token generation stops at. Template text after it (a newline) is formatting, not the reply.
    markers = [t for t in range(start, len(through)) if through[t] in special_ids]
    if not markers:
        return AssistantTurn(start, len(through), len(through))
    return AssistantTurn(start, markers[-1], markers[-1] + 1)


def _fit_conversation(ids: list[int], turns: list[AssistantTurn], max_seq_len, overlong):
    """(ids, turns, outcome) within max_seq_len, or None when the sample is dropped."""
    if max_seq_len is None or len(ids) <= max_seq_len:
        return ids, turns, KEPT
    if overlong == "drop":
        return None
    fitting = [turn for turn in turns if turn.end <= max_seq_len]
    if fitting:  # whole trailing turns go; every kept reply keeps its end-of-turn token
        return ids[: fitting[-1].end], fitting, TRUNCATED
    if not turns:
        return ids[:max_seq_len], [], TRUNCATED  # no target at all: counted as dropped_no_target
    first = turns[0]
    marker = ids[first.marker : first.end]
    room = max_seq_len - first.start - len(marker)  # reply tokens that fit before its end-of-turn
    if room < 1:  # the context before the first reply does not fit: dropped, as for prompts
        return None
    cut = ids[: first.start + room] + marker
    return cut, [AssistantTurn(first.start, first.start + room, len(cut))], TRUNCATED


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
    eos = _eos(tokenizer)
    return PairParts(_bos(tokenizer), _token_ids(tokenizer, prompt) if prompt else [],
                     _token_ids(tokenizer, chosen) + eos, _token_ids(tokenizer, rejected) + eos)


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
    before = _chat_ids(tokenizer, context, add_generation_prompt=True)
    special_ids, eos = special_token_ids(tokenizer), _eos(tokenizer)
    responses = {}
    for side, messages in conversations.items():
        through = _chat_ids(tokenizer, messages, add_generation_prompt=False)
        if through[: len(before)] != before:
            raise DataConfigError(
                f"data.format=preference: the chat template of model.tokenizer does not render the {side} "
                f"conversation incrementally (its messages before the final reply, with "
                f"add_generation_prompt=True, are not a token prefix of the whole), so the reply cannot be "
                f"located; use a template that renders each turn on its own, or give strings")
        turn = _turn_span(len(before), through, special_ids)
        response = through[turn.start : turn.end]  # through the end-of-turn token; formatting after it goes
        # A reply ends at the template's end of turn, where SFT taught it to stop and rollouts stop: the token a
        # reward model scores. Only a template that prints no special token after the reply gets eos.
        responses[side] = response if response[-1:] and response[-1] in special_ids else response + eos
    head = before[:1] if before[:1] == _bos(tokenizer) else []
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


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    # transformers 5 returns a BatchEncoding here; older versions a plain list
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def _token_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def _dropped(outcome: str) -> dict:
    return {"input_ids": [], "labels": [], "outcome": outcome}


FORMATS = {
    "text": encode_text,
    "prompt_response": encode_prompt_response,
    "alpaca": encode_alpaca,
    "messages": encode_messages,
    "preference": encode_preference,
}
