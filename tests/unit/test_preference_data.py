"""Preference pairs: shared loss-free prompts, eos last, keep_end truncation, drops, and the synthetic pairs.

The shipped tokenizer is byte-level: one token per ASCII character and one per special token, so
expected lengths below are counted by hand from the strings. Its pad token is its eos.
"""

import json
from collections import Counter

import datasets
import pytest

from llmtrain.data import PREFERENCE_FORMATS
from llmtrain.data.dataset import PAIR_COLUMNS, build_examples
from llmtrain.data.errors import DataConfigError
from llmtrain.data.formats import FORMATS, DataStats, check_columns
from llmtrain.data.synthetic import ASSET_DATA_DIR, reversal_preferences
from llmtrain.losses.lm import IGNORE_INDEX

SIDES = ("chosen", "rejected")


def encode(tokenizer, row: dict, max_seq_len: int | None = None, overlong: str = "truncate") -> dict:
    return FORMATS["preference"](row, tokenizer, max_seq_len, overlong)


def split(tokenizer, encoded: dict, side: str) -> tuple[str, str]:
    """(loss-free context, targets) of one side, decoded; checks that targets are one aligned tail."""
    ids, labels = encoded[f"{side}_input_ids"], encoded[f"{side}_labels"]
    assert len(ids) == len(labels)
    start = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert all(label == IGNORE_INDEX for label in labels[:start])
    assert labels[start:] == ids[start:], "targets run from the first target to the end, aligned with the ids"
    return tokenizer.decode(ids[:start]), tokenizer.decode(ids[start:])


def rows_of(records: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(records)


def chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


def test_pad_is_eos_in_the_shipped_tokenizer(tokenizer):
    # the reason pairs must carry their own lengths: an eos and a pad look alike
    assert tokenizer.pad_token_id == tokenizer.eos_token_id


def test_prompt_chosen_rejected_strings(tokenizer):
    row = {"prompt": "reverse: abc\n", "chosen": "cba", "rejected": "abc", "margin": 1.5, "kind": "easy"}
    encoded = encode(tokenizer, row)
    assert split(tokenizer, encoded, "chosen") == ("<s>reverse: abc\n", "cba</s>")
    assert split(tokenizer, encoded, "rejected") == ("<s>reverse: abc\n", "abc</s>")
    assert (encoded["margin"], encoded["kind"], encoded["outcome"]) == (1.5, "easy", "kept")
    prompt_len = 1 + len("reverse: abc\n")
    assert encoded["chosen_labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert encoded["chosen_input_ids"][:prompt_len] == encoded["rejected_input_ids"][:prompt_len]


def test_no_prompt_every_token_after_bos_is_a_target(tokenizer):
    encoded = encode(tokenizer, {"chosen": "good answer", "rejected": "bad"})
    assert split(tokenizer, encoded, "chosen") == ("<s>", "good answer</s>")
    assert split(tokenizer, encoded, "rejected") == ("<s>", "bad</s>")
    assert (encoded["margin"], encoded["kind"]) == (0.0, "")


def test_chat_sides_share_the_prompt_and_target_only_the_final_reply(tokenizer):
    context = chat(("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "name?"))
    row = {"chosen": context + chat(("assistant", "bot")), "rejected": context + chat(("assistant", "no"))}
    encoded = encode(tokenizer, row)
    rendered_context = tokenizer.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
    # through the template's end-of-turn token, where SFT stops and rollouts stop (its "\n" after it is formatting)
    assert split(tokenizer, encoded, "chosen") == (rendered_context, "bot<|end|>")
    assert split(tokenizer, encoded, "rejected") == (rendered_context, "no<|end|>")


def test_conversational_prompt_list_with_one_message_sides(tokenizer):
    prompt = chat(("user", "hi"))
    trl = encode(tokenizer, {"prompt": prompt, "chosen": chat(("assistant", "yo")),
                             "rejected": chat(("assistant", "go away"))})
    whole = encode(tokenizer, {"chosen": prompt + chat(("assistant", "yo")),
                               "rejected": prompt + chat(("assistant", "go away"))})
    assert trl == whole
    assert split(tokenizer, trl, "chosen") == ("<|user|>\nhi<|end|>\n<|assistant|>\n", "yo<|end|>")
    examples, _ = build_examples(rows_of([{"prompt": prompt, "chosen": chat(("assistant", "yo")),
                                           "rejected": chat(("assistant", "go away"))}]),
                                 tokenizer, fmt="preference", max_seq_len=64)  # through arrow's structs
    assert {side: examples[0][f"{side}_input_ids"] for side in SIDES} == \
        {side: trl[f"{side}_input_ids"] for side in SIDES}


def test_string_prompt_beside_conversations_is_checked_not_rendered(tokenizer):
    # UltraFeedback's layout: the prompt string repeats the user message of each conversation
    sides = {"chosen": chat(("user", "hi"), ("assistant", "yo")), "rejected": chat(("user", "hi"), ("assistant", "no"))}
    assert encode(tokenizer, {"prompt": "hi", **sides}) == encode(tokenizer, sides)
    with pytest.raises(DataConfigError, match="string prompt"):
        encode(tokenizer, {"prompt": "something else", **sides})


def test_chat_sides_that_differ_before_the_final_reply_are_an_error(tokenizer):
    row = {"chosen": chat(("user", "hi"), ("assistant", "yo")), "rejected": chat(("user", "hey"), ("assistant", "no"))}
    with pytest.raises(DataConfigError, match="data.format=preference: message 0 differs.*share"):
        encode(tokenizer, row)


def test_mixed_shapes_are_an_error(tokenizer):
    with pytest.raises(DataConfigError, match="mixes shapes"):
        encode(tokenizer, {"chosen": "yo", "rejected": chat(("user", "hi"), ("assistant", "no"))})


@pytest.mark.parametrize("row", [
    {"prompt": "p\n", "chosen": "a", "rejected": "ab"},
    {"chosen": "some text", "rejected": "other"},
    {"chosen": chat(("user", "hi"), ("assistant", "yo")), "rejected": chat(("user", "hi"), ("assistant", "no"))},
])
def test_every_side_ends_in_its_stop_token(tokenizer, row):
    """eos for text; a conversation's reply ends at the template's end of turn (models/stop_tokens.py)."""
    from llmtrain.models.stop_tokens import end_of_turn_id

    stop = end_of_turn_id(tokenizer) if isinstance(row["chosen"], list) else tokenizer.eos_token_id
    assert stop == (tokenizer.convert_tokens_to_ids("<|end|>") if isinstance(row["chosen"], list) else 257)
    encoded = encode(tokenizer, row)
    for side in SIDES:
        assert encoded[f"{side}_input_ids"][-1] == stop
        assert encoded[f"{side}_labels"][-1] == stop


def test_truncation_keeps_bos_the_end_of_the_prompt_and_eos(tokenizer):
    prompt = "reverse: abcdefgh\n"
    row = {"prompt": prompt, "chosen": "hgfedcba", "rejected": "abc"}
    max_seq_len = 1 + 6 + len("hgfedcba") + 1  # bos + the last 6 prompt tokens + the longer reply + eos
    encoded = encode(tokenizer, row, max_seq_len)
    assert encoded["outcome"] == "truncated"
    assert len(encoded["chosen_input_ids"]) == max_seq_len
    assert split(tokenizer, encoded, "chosen") == ("<s>defgh\n", "hgfedcba</s>")
    assert split(tokenizer, encoded, "rejected") == ("<s>defgh\n", "abc</s>")  # the same prompt tokens


def test_truncation_of_a_chat_prompt_keeps_its_end(tokenizer):
    row = {"chosen": chat(("user", "a long question"), ("assistant", "yes")),
           "rejected": chat(("user", "a long question"), ("assistant", "no"))}
    max_seq_len = 12  # "yes<|end|>" is 4 tokens: the last 8 prompt tokens are kept (this template has no bos)
    encoded = encode(tokenizer, row, max_seq_len)
    assert encoded["outcome"] == "truncated"
    assert split(tokenizer, encoded, "chosen") == ("tion<|end|>\n<|assistant|>\n", "yes<|end|>")


def test_a_reply_that_alone_overflows_is_dropped(tokenizer):
    row = {"prompt": "p\n", "chosen": "abcdefgh", "rejected": "x"}
    assert encode(tokenizer, row, 1 + 8 + 1)["outcome"] == "truncated"  # the whole prompt goes, bos stays
    assert encode(tokenizer, row, 1 + 8)["outcome"] == "dropped_overlong"


def test_drop_policy_drops_every_overlong_pair(tokenizer):
    row = {"prompt": "reverse: abcdefgh\n", "chosen": "hgfedcba", "rejected": "abc"}
    assert encode(tokenizer, row, 20, "drop")["outcome"] == "dropped_overlong"


def test_examples_have_the_pair_columns_and_stats_count_every_drop(tokenizer):
    rows = rows_of([
        {"prompt": "reverse: ab\n", "chosen": "ba", "rejected": "ab", "kind": "easy", "margin": 2.0},
        {"prompt": "reverse: aa\n", "chosen": "aa", "rejected": "aa", "kind": "easy", "margin": None},
        {"prompt": "reverse: cd\n", "chosen": "dc", "rejected": "  ", "kind": "hard", "margin": None},
        {"prompt": "reverse: cd\n", "chosen": "", "rejected": "cd", "kind": None, "margin": None},
        {"prompt": "p\n", "chosen": "x" * 40, "rejected": "y", "kind": None, "margin": None},
        {"prompt": "reverse: abcdefghijklmnopqrstuvwxyz\n", "chosen": "zyx", "rejected": "xyz", "kind": "hard",
         "margin": None},
    ])
    examples, stats = build_examples(rows, tokenizer, fmt="preference", max_seq_len=32)
    assert (stats.samples_in, stats.samples_out, stats.truncated) == (6, 2, 1)
    assert (stats.dropped_identical, stats.dropped_empty, stats.dropped_overlong) == (1, 2, 1)
    assert "dropped_identical=1" in stats.summary() and "dropped_empty=2" in stats.summary()
    first = examples[0]
    assert tuple(first) == PAIR_COLUMNS and "outcome" not in first
    assert (first["margin"], first["kind"]) == (2.0, "easy")
    assert first["length"] == max(len(first["chosen_input_ids"]), len(first["rejected_input_ids"])) == 16
    assert first["num_targets"] == 3 + 3  # "ba</s>" and "ab</s>"
    assert examples[1]["kind"] == "hard" and examples[1]["margin"] == 0.0
    assert len(examples[1]["chosen_input_ids"]) == 32
    assert examples.row_lengths() == [16, 32]
    assert stats.tokens == 16 + 16 + 32 + 32 and stats.target_tokens == 6 + 8


def test_stats_keep_every_counter_in_the_summary():
    names = [part.split("=")[0] for part in DataStats().summary().split()]
    assert {"dropped_identical", "dropped_empty", "dropped_overlong", "dropped_no_target"} <= set(names)


@pytest.mark.parametrize("row", [
    {"chosen": chat(("user", "hi"), ("assistant", "")), "rejected": chat(("user", "hi"), ("assistant", "no"))},
    {"chosen": chat(("user", "hi")), "rejected": chat(("user", "hi"), ("assistant", "no"))},
    {"chosen": None, "rejected": "no"},
])
def test_a_side_without_reply_content_is_dropped_as_empty(tokenizer, row):
    assert encode(tokenizer, row)["outcome"] == "dropped_empty"


def test_missing_column_names_the_column_and_the_field(tokenizer):
    rows = rows_of([{"prompt": "p", "chosen": "a", "reject": "b"}])
    with pytest.raises(DataConfigError, match="data.format=preference needs a column 'rejected'"):
        build_examples(rows, tokenizer, fmt="preference", max_seq_len=32)
    with pytest.raises(DataConfigError, match="data.format=preference needs a column 'chosen'"):
        check_columns(["prompt", "response"], "preference")


def test_packing_pairs_is_refused(tokenizer):
    rows = rows_of([{"chosen": "a", "rejected": "b"}])
    with pytest.raises(DataConfigError, match="data.packing"):
        build_examples(rows, tokenizer, fmt="preference", max_seq_len=32, packing=True)
    with pytest.raises(DataConfigError, match="data.overlong=chunk"):
        build_examples(rows, tokenizer, fmt="preference", max_seq_len=32, overlong="chunk")
    assert PREFERENCE_FORMATS == ("preference",)


def is_adjacent_swap(a: str, b: str) -> bool:
    diff = [i for i in range(len(a)) if a[i] != b[i]] if len(a) == len(b) else []
    return len(diff) == 2 and diff[1] == diff[0] + 1 and (a[diff[0]], a[diff[1]]) == (b[diff[1]], b[diff[0]])


def is_substitution(a: str, b: str) -> bool:
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def test_synthetic_pairs_reverse_and_hard_negatives_are_one_edit_away():
    rows = reversal_preferences(2000, seed=11)
    assert Counter(row["kind"] for row in rows) == {"easy": 1000, "hard": 1000}
    assert len({row["kind"] for row in rows[:20]}) == 2  # interleaved, not in blocks
    edits = Counter()
    for row in rows:
        word = row["prompt"].removeprefix("reverse: ").removesuffix("\n")
        assert row["prompt"] == f"reverse: {word}\n" and 3 <= len(word) <= 8 and word.isalpha() and word.islower()
        chosen, rejected = row["chosen"], row["rejected"]
        assert chosen == word[::-1] and rejected != chosen
        if row["kind"] == "hard":
            swap, sub = is_adjacent_swap(chosen, rejected), is_substitution(chosen, rejected)
            assert swap or sub
            edits["swap" if swap else "substitution"] += 1
        else:
            edits["unreversed" if rejected == word else "other word"] += 1
            assert abs(len(rejected) - len(word)) <= 1
    assert set(edits) == {"swap", "substitution", "unreversed", "other word"} and min(edits.values()) > 300
    assert reversal_preferences(2000, seed=11) == rows  # the same seed twice: the same pairs in the same order
    other = reversal_preferences(2000, seed=12)  # another seed: other words, not only another order
    assert other != rows and {r["prompt"] for r in other[:100]} != {r["prompt"] for r in rows[:100]}
    assert {row["kind"] for row in reversal_preferences(50, seed=11, kinds=("hard",))} == {"hard"}


def test_palindromes_never_get_themselves_as_the_easy_negative():
    rows = [row for seed in range(3) for row in reversal_preferences(3000, seed=seed, kinds=("easy",), max_len=3)]
    palindromes = [row for row in rows if row["chosen"] == row["chosen"][::-1]]
    assert palindromes and all(row["rejected"] != row["chosen"] for row in palindromes)


def test_shipped_preference_assets_are_balanced_and_encode(tokenizer):
    for name, size in (("reverse_prefs_train.jsonl", 4000), ("reverse_prefs_eval.jsonl", 512)):
        rows = [json.loads(line) for line in (ASSET_DATA_DIR / name).read_text().splitlines()]
        assert len(rows) == size and Counter(row["kind"] for row in rows) == {"easy": size // 2, "hard": size // 2}
    examples, stats = build_examples(rows_of(rows), tokenizer, fmt="preference", max_seq_len=64)
    assert stats.samples_out == len(rows) == len(examples)
