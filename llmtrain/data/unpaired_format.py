"""The `unpaired` format (TRL's unpaired preference layout: `prompt`, `completion`, `label` true when desirable), and
the unpaired examples KTO trains on, from it or from `preference` pairs (each pair one desirable and one undesirable
row, as TRL's `unpair_preference_dataset`).

An unpaired example also carries its KL sequence: its own prompt with the completion of the row before it (row 0 takes
the last row's), the mismatched prompt-completion pair on which KTO estimates the policy-vs-reference KL (TRL rotates
the completions by one within each batch; here within the whole data set, so the pairs do not depend on the batch
layout). Pairs are unpaired as [every chosen; every rejected], so a row's neighbour answers another prompt.
"""

from __future__ import annotations

import random

from llmtrain.data.errors import DataConfigError
from llmtrain.data.format_spec import DataFormat
from llmtrain.data.outcomes import DROPPED_EMPTY, DROPPED_OVERLONG
from llmtrain.data.preference_format import _chat_pair, _final_reply, _fit_pair, _text_pair
from llmtrain.data.synthetic import NEGATIVES, random_word
from llmtrain.losses.lm import IGNORE_INDEX

# An item of an unpaired dataset: the completion's sequence, its KL sequence, whether it is desirable, the index of
# the pair it came from (-1 for unpaired data: eval_reward_accuracy compares the two rows of a pair) and `length`.
UNPAIRED_COLUMNS = ("input_ids", "labels", "kl_input_ids", "kl_labels", "desirable", "pair", "length")


def encode_unpaired(row: dict, tokenizer, max_seq_len: int | None = None, overlong: str = "truncate") -> dict:
    """A loss-free prompt and a completion ending in its stop token (as one side of `encode_preference`), and its
    label. String prompt and completion, or chat messages (an optional `prompt` list, a `completion` list ending
    in the assistant's reply). Over-long rows lose the start of the prompt (`truncate`) or are dropped (`drop`)."""
    prompt, completion, label = row.get("prompt"), row.get("completion"), row.get("label")
    if completion is None or label is None:
        return _dropped(DROPPED_EMPTY)
    if isinstance(completion, str) and isinstance(prompt, (str, type(None))):
        if not completion.strip():
            return _dropped(DROPPED_EMPTY)
        parts = _text_pair(prompt or "", completion, completion, tokenizer)
    elif isinstance(completion, list) and isinstance(prompt, (list, str, type(None))):
        if _final_reply(completion) is None:
            return _dropped(DROPPED_EMPTY)
        parts = _chat_pair(prompt, completion, completion, tokenizer)
    else:
        raise DataConfigError(f"data.format=unpaired: a row mixes shapes (prompt {type(prompt).__name__}, completion "
                              f"{type(completion).__name__}); give a string completion (with an optional string "
                              "prompt) or a list of messages (with an optional prompt list of messages)")
    fitted = _fit_pair(parts, max_seq_len, overlong)
    if fitted is None:
        return _dropped(DROPPED_OVERLONG)
    parts, outcome = fitted
    context = parts.head + parts.prompt
    return {"input_ids": context + parts.chosen, "labels": [IGNORE_INDEX] * len(context) + parts.chosen,
            "desirable": bool(label), "outcome": outcome}


def _dropped(outcome: str) -> dict:
    return {"input_ids": [], "labels": [], "desirable": False, "outcome": outcome}


def prompt_length(labels: list[int]) -> int:
    """Tokens before the completion: the leading loss-free ones."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def mismatched(ids: list[int], labels: list[int], other_ids: list[int], other_labels: list[int],
               max_seq_len: int | None) -> tuple[list[int], list[int]]:
    """(ids, labels) of this row's prompt with the other row's completion; over max_seq_len the prompt loses tokens
    after its first (the bos) from the left, as `truncate` cuts prompts."""
    cut, other_cut = prompt_length(labels), prompt_length(other_labels)
    prompt, completion = ids[:cut], other_ids[other_cut:]
    room = len(prompt) if max_seq_len is None else max_seq_len - len(completion)
    if len(prompt) > room:
        prompt = prompt[:1] + prompt[len(prompt) - room + 1:] if room >= 1 else []
    return prompt + completion, [IGNORE_INDEX] * len(prompt) + other_labels[other_cut:]


def unpaired_columns(kept, max_seq_len: int | None, from_pairs: bool) -> dict[str, list]:
    """Encoded rows (arrow: `preference` pairs or `unpaired` rows, dropped ones removed) -> UNPAIRED_COLUMNS."""
    if from_pairs:
        ids = list(kept["chosen_input_ids"]) + list(kept["rejected_input_ids"])
        labels = list(kept["chosen_labels"]) + list(kept["rejected_labels"])
        desirable, pair = [True] * len(kept) + [False] * len(kept), list(range(len(kept))) * 2
    else:
        ids, labels, desirable = list(kept["input_ids"]), list(kept["labels"]), list(kept["desirable"])
        pair = [-1] * len(ids)
    kl = [mismatched(ids[i], labels[i], ids[i - 1], labels[i - 1], max_seq_len) for i in range(len(ids))]
    return {"input_ids": ids, "labels": labels, "kl_input_ids": [k for k, _ in kl], "kl_labels": [k for _, k in kl],
            "desirable": desirable, "pair": pair,
            "length": [max(len(a), len(k)) for a, (k, _) in zip(ids, kl)]}


def pairs_of(examples) -> list[dict]:
    """Unpaired examples that came from pairs -> those pairs again (`chosen_*`/`rejected_*` ids and labels), in pair
    order: what finished_run rescores; rows of unpaired data (pair -1) have no partner and are left out."""
    sides: dict[int, dict] = {}
    for i in range(len(examples)):
        example = examples[i]
        if example["pair"] >= 0:
            sides.setdefault(example["pair"], {})["chosen" if example["desirable"] else "rejected"] = example
    return [{f"{side}_{key}": both[side][key] for side in ("chosen", "rejected") for key in ("input_ids", "labels")}
            for _, both in sorted(sides.items()) if len(both) == 2]


def reversal_unpaired(n: int, seed: int, min_len: int = 3, max_len: int = 8) -> list[dict]:
    """The reversal task as n unpaired rows: about half the reversal (desirable), half an easy negative."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = random_word(rng, min_len, max_len)
        desirable = rng.random() < 0.5
        completion = word[::-1] if desirable else NEGATIVES["easy"](rng, word, word[::-1], min_len, max_len)
        rows.append({"prompt": f"reverse: {word}\n", "completion": completion, "label": desirable})
    return rows


DATA_FORMATS = (DataFormat("unpaired", columns=(("completion",), ("label",)), encode=encode_unpaired,
                           optional=("prompt",), example="unpaired", synthetic=reversal_unpaired),)
