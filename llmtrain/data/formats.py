"""Rows -> `input_ids` with aligned `labels` (IGNORE_INDEX where no loss), one encoder per format.

Every encoder returns {"input_ids", "labels", "outcome"}; `outcome` says whether the sample was
kept as is, truncated, chunked, or dropped, so the counts in `DataStats` come from the same code that acts.
Target tokens are counted the way the loss counts them: labels[1:] (label 0 is never predicted).
The `preference` encoder returns a pair instead: `chosen_*` and `rejected_*` ids and labels (see
`preference_format.encode_preference`), with the same `outcome`; `unpaired` one completion and its label
(`unpaired_format`). `FORMAT_SPECS` is the registry of every format (data/format_spec.py).
"""

import json
from dataclasses import asdict, dataclass

from llmtrain.data import preference_format, unpaired_format
from llmtrain.data.errors import DataConfigError
from llmtrain.data.format_spec import DataFormat
from llmtrain.data.outcomes import (
    CHUNKED,
    DROPPED_EMPTY,
    DROPPED_IDENTICAL,
    DROPPED_NO_TARGET,
    DROPPED_OVERLONG,
    KEPT,
    NEXT_CHUNK,
    OVERLONG_POLICIES,
    TRAINED,
    TRUNCATED,
)
from llmtrain.data.synthetic import grammar_text_samples, reversal_samples
from llmtrain.data.tokens import AssistantTurn, bos_ids, chat_ids, eos_ids, text_ids, turn_span
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.models.stop_tokens import special_token_ids

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"

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


def check_columns(column_names: list[str], fmt: str, ignored: tuple[str, ...] = ()) -> None:
    """The format's columns are there, and no column carrying a preference signal would be dropped unread."""
    if fmt not in REQUIRED_COLUMNS:
        raise DataConfigError(f"data.format={fmt!r} is unknown; choose one of {sorted(REQUIRED_COLUMNS)}")
    for accepted in REQUIRED_COLUMNS[fmt]:
        if not any(name in column_names for name in accepted):
            raise DataConfigError(
                f"data.format={fmt} needs a column {' or '.join(repr(n) for n in accepted)}, but the data "
                f"has columns {sorted(column_names)}; rename the column or set data.format to match the data"
            )
    dropped = [name for name in unread_signal_columns(column_names, fmt) if name not in ignored]
    if dropped:
        readers = "; ".join(f"{name!r} is read by data.format="
                            + " or ".join(n for n, spec in FORMAT_SPECS.items() if name in spec.known_columns)
                            for name in dropped)
        raise DataConfigError(
            f"data.format={fmt} does not read the data's column(s) {dropped}, which carry a preference signal "
            f"({readers}): training would drop them unread. Set data.format to the format that reads them, or "
            f"data.ignore_columns=[{','.join(dropped)}] to train without them")


def unread_signal_columns(column_names: list[str], fmt: str) -> list[str]:
    """The data's columns that a pair or unpaired format reads and no sequence format does (chosen, rejected, label,
    margin, kind: what marks an example better or worse) which data.format=fmt does not read. Other unread columns
    (ids, sources, a conversation kept beside its pair) are the hub's usual metadata and are left alone."""
    content = {name for spec in FORMAT_SPECS.values() if spec.example == "sequence" for name in spec.known_columns}
    signal = {name for spec in FORMAT_SPECS.values() if spec.example != "sequence" for name in spec.known_columns}
    return sorted(set(column_names) & (signal - content) - set(FORMAT_SPECS[fmt].known_columns))


def check_tokenizer(tokenizer, fmt: str) -> None:
    if fmt == "messages" and getattr(tokenizer, "chat_template", None) is None:
        raise DataConfigError("data.format=messages needs a chat template, but model.tokenizer has none; "
                              "use a tokenizer that ships one, or set data.format to prompt_response")
    if fmt in ("prompt_response", "alpaca") and tokenizer.eos_token_id is None:
        raise DataConfigError(f"data.format={fmt} appends an eos token so the model learns to stop, but "
                              "model.tokenizer has no eos_token; use a tokenizer that defines one")
    if FORMAT_SPECS[fmt].example != "sequence" and tokenizer.eos_token_id is None:
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
    if FORMAT_SPECS[fmt].example != "sequence":  # a kept side always has targets: its response (never cut), eos
        return encoded
    if encoded["outcome"] != DROPPED_OVERLONG and count_targets(encoded["labels"]) == 0:
        return _dropped(DROPPED_NO_TARGET)
    return encoded


def encode_text(row: dict, tokenizer, max_seq_len: int | None = None, overlong: str = "truncate") -> dict:
    """Every token a target. Over-long with `chunk`: the whole text, marked CHUNKED (see `split_chunks`)."""
    ids = bos_ids(tokenizer) + text_ids(tokenizer, row["text"]) + eos_ids(tokenizer)
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
    prompt_ids = bos_ids(tokenizer) + text_ids(tokenizer, prompt)
    response_ids = text_ids(tokenizer, response)
    eos = eos_ids(tokenizer)
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
    """Chat rendered by the tokenizer's template; only assistant turns (through end-of-turn) are targets: a turn that
    calls tools is one, the tool results (`role: tool`) are context.

    The template owns the special tokens (a bos included), so none are added here. A `tools` column (the JSON
    schemas of the tools, as a list or a JSON string: TRL's SFTTrainer's column) is rendered into every prompt as the
    template renders tools, so the model learns its calls in the context a tool-calling rollout gives it.
    """
    messages, tools = row["messages"], row_tools(row)
    ids = chat_ids(tokenizer, messages, add_generation_prompt=False, tools=tools)
    turns = _assistant_turns(tokenizer, messages, ids, tools)
    fitted = _fit_conversation(ids, turns, max_seq_len, overlong)
    if fitted is None:
        return _dropped(DROPPED_OVERLONG)
    ids, turns, outcome = fitted
    labels = [IGNORE_INDEX] * len(ids)
    for turn in turns:
        labels[turn.start : turn.end] = ids[turn.start : turn.end]
    return {"input_ids": ids, "labels": labels, "outcome": outcome}


def row_tools(row: dict) -> list[dict] | None:
    """The row's `tools` column as a list of JSON schemas (None when absent or empty)."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as error:
            raise DataConfigError(f"data.format=messages: the `tools` column holds a string that is not JSON "
                                  f"({error}); give the tools' JSON schemas as a list, or that list as a JSON "
                                  "string") from error
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataConfigError(f"data.format=messages: the `tools` column must be a list of JSON schemas (or that list "
                              f"as a JSON string), got {type(tools).__name__}")
    return tools or None


def _assistant_turns(tokenizer, messages: list[dict], full_ids: list[int],
                     tools: list[dict] | None = None) -> list[AssistantTurn]:
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
        before = chat_ids(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        through = chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        if through[: len(before)] != before or full_ids[: len(through)] != through:
            raise DataConfigError(
                f"data.format=messages: the chat template of model.tokenizer does not render turns "
                f"incrementally (messages[:{i}] with add_generation_prompt=True is not a token prefix of "
                f"messages[:{i + 1}], or that is not a prefix of the whole conversation), so assistant "
                f"tokens cannot be located; use a template that renders each turn on its own, or "
                f"convert the data to data.format=prompt_response"
            )
        turns.append(turn_span(len(before), through, special_ids))
    return turns


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


def _dropped(outcome: str) -> dict:
    return {"input_ids": [], "labels": [], "outcome": outcome}


# The sequence formats; the pair and unpaired ones are declared by their modules.
DATA_FORMATS = (
    DataFormat("text", columns=(("text",),), encode=encode_text, synthetic=grammar_text_samples),
    DataFormat("prompt_response", columns=(("prompt",), ("response", "completion")), encode=encode_prompt_response,
               synthetic=reversal_samples),
    DataFormat("alpaca", columns=(("instruction",), ("output",)), encode=encode_alpaca, optional=("input",)),
    DataFormat("messages", columns=(("messages",),), encode=encode_messages, optional=("tools",)),
)
# The format registry: every format by name.
FORMAT_SPECS: dict[str, DataFormat] = {
    spec.name: spec for module_formats in (DATA_FORMATS, preference_format.DATA_FORMATS, unpaired_format.DATA_FORMATS)
    for spec in module_formats}
FORMATS = {name: spec.encode for name, spec in FORMAT_SPECS.items()}
REQUIRED_COLUMNS = {name: list(spec.columns) for name, spec in FORMAT_SPECS.items()}
