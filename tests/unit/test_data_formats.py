"""Formats: which tokens are targets, the over-long policy, the counts, and the config errors.

The shipped tokenizer is byte-level: one token per ASCII character and one per special token,
so expected lengths below are counted by hand from the strings.
"""

import copy

import datasets
import pytest

from llmtrain.data.dataset import build_examples
from llmtrain.data.errors import DataConfigError
from llmtrain.data.formats import FORMATS, check_columns
from llmtrain.losses.lm import IGNORE_INDEX


def target_runs(tokenizer, encoded: dict) -> list[str]:
    """Decoded text of each contiguous run of target tokens."""
    runs, current = [], []
    for token, label in zip(encoded["input_ids"], encoded["labels"]):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token, "a target label must be the token itself (labels are aligned)"
            current.append(token)
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def context_text(tokenizer, encoded: dict) -> str:
    return tokenizer.decode([t for t, label in zip(encoded["input_ids"], encoded["labels"]) if label == IGNORE_INDEX])


def test_text_all_tokens_are_targets_between_bos_and_eos(tokenizer):
    encoded = FORMATS["text"]({"text": "a cat."}, tokenizer)
    assert tokenizer.decode(encoded["input_ids"]) == "<s>a cat.</s>"
    assert encoded["labels"] == encoded["input_ids"]


@pytest.mark.parametrize("response_column", ["response", "completion"])
def test_prompt_response_targets_only_the_response_and_eos(tokenizer, response_column):
    encoded = FORMATS["prompt_response"]({"prompt": "reverse: abc\n", response_column: "cba"}, tokenizer)
    assert target_runs(tokenizer, encoded) == ["cba</s>"]
    assert context_text(tokenizer, encoded) == "<s>reverse: abc\n"


@pytest.mark.parametrize("input_text", ["hello world", ""])
def test_alpaca_targets_only_the_output_and_eos(tokenizer, input_text):
    row = {"instruction": "Shout it.", "input": input_text, "output": "HELLO WORLD"}
    encoded = FORMATS["alpaca"](row, tokenizer)
    assert target_runs(tokenizer, encoded) == ["HELLO WORLD</s>"]
    prompt = context_text(tokenizer, encoded)
    assert prompt.startswith("<s>") and "Shout it." in prompt and prompt.endswith("### Response:\n")
    assert ("### Input:\nhello world" in prompt) == bool(input_text)


def test_messages_only_assistant_turns_are_targets(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "name?"},
        {"role": "assistant", "content": "bot"},
    ]
    encoded = FORMATS["messages"]({"messages": messages}, tokenizer)
    assert tokenizer.decode(encoded["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert target_runs(tokenizer, encoded) == ["hello<|end|>", "bot<|end|>"]
    context = context_text(tokenizer, encoded)
    assert "be brief" in context and "hi" in context and "name?" in context
    assert "hello" not in context and "bot" not in context


def test_prompt_response_truncation_cuts_the_response_and_keeps_eos(tokenizer):
    prompt, response = "reverse: abcdefgh\n", "hgfedcba"
    max_seq_len = 1 + len(prompt) + 3 + 1  # bos + prompt + 3 response tokens + eos
    encoded = FORMATS["prompt_response"]({"prompt": prompt, "response": response}, tokenizer, max_seq_len)
    assert encoded["outcome"] == "truncated"
    assert len(encoded["input_ids"]) == max_seq_len
    assert encoded["input_ids"][-1] == tokenizer.eos_token_id
    assert target_runs(tokenizer, encoded) == ["hgf</s>"]


def test_prompt_that_alone_overflows_is_dropped(tokenizer):
    prompt = "reverse: abcdefgh\n"
    encoded = FORMATS["prompt_response"]({"prompt": prompt, "response": "x"}, tokenizer, len(prompt))
    assert encoded["outcome"] == "dropped_overlong" and encoded["input_ids"] == []


def test_text_truncation_cuts_the_tail(tokenizer):
    encoded = FORMATS["text"]({"text": "abcdefgh"}, tokenizer, 5)
    assert encoded["outcome"] == "truncated"
    assert tokenizer.decode(encoded["input_ids"]) == "<s>abcd"


def two_turns(first_reply: str = "abcdefgh") -> list[dict]:
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "second reply"},
    ]


def test_messages_truncation_drops_whole_trailing_turns(tokenizer):
    # "<|user|>\nhi<|end|>\n<|assistant|>\nabcdefgh<|end|>": 7 special/newline tokens + "hi" + reply
    first_turn_len = 7 + len("hi") + len("abcdefgh")
    encoded = FORMATS["messages"]({"messages": two_turns()}, tokenizer, first_turn_len + 5)
    assert encoded["outcome"] == "truncated"
    assert len(encoded["input_ids"]) == first_turn_len
    assert encoded["input_ids"][-1] == tokenizer.convert_tokens_to_ids("<|end|>")
    assert target_runs(tokenizer, encoded) == ["abcdefgh<|end|>"]


def test_messages_truncation_cuts_the_first_reply_and_keeps_end_of_turn(tokenizer):
    context_len = 6 + len("hi")  # "<|user|>\nhi<|end|>\n<|assistant|>\n"
    max_seq_len = context_len + 3 + 1  # 3 reply tokens + <|end|>
    encoded = FORMATS["messages"]({"messages": two_turns()}, tokenizer, max_seq_len)
    assert encoded["outcome"] == "truncated"
    assert len(encoded["input_ids"]) == max_seq_len
    assert target_runs(tokenizer, encoded) == ["abc<|end|>"]


def test_messages_drop_policy_drops_instead_of_cutting(tokenizer):
    encoded = FORMATS["messages"]({"messages": two_turns()}, tokenizer, 20, "drop")
    assert encoded["outcome"] == "dropped_overlong"


def rows_of(records: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(records)


def test_overlong_policies_count_drops_and_truncations(tokenizer):
    rows = rows_of([{"text": "ab"}, {"text": "a" * 40}, {"text": "cd"}, {"text": "b" * 50}])
    _, dropped = build_examples(rows, tokenizer, fmt="text", max_seq_len=16, overlong="drop")
    assert (dropped.samples_in, dropped.samples_out, dropped.dropped_overlong, dropped.truncated) == (4, 2, 2, 0)
    examples, truncated = build_examples(rows, tokenizer, fmt="text", max_seq_len=16, overlong="truncate")
    assert (truncated.samples_out, truncated.dropped_overlong, truncated.truncated) == (4, 0, 2)
    assert [len(examples[i]["input_ids"]) for i in range(4)] == [4, 16, 4, 16]
    assert truncated.tokens == 4 + 16 + 4 + 16
    assert truncated.target_tokens == 3 + 15 + 3 + 15  # label 0 is never predicted


def test_chunk_policy_trains_on_every_token_of_a_long_text(tokenizer):
    text = "".join(chr(ord("a") + i % 26) for i in range(37))  # bos + 37 + eos = 39 tokens: rows 16, 16, 7
    rows = rows_of([{"text": "ab"}, {"text": text}, {"text": "c" * 15}])  # 17 tokens: 16 + one left over
    examples, stats = build_examples(rows, tokenizer, fmt="text", max_seq_len=16, overlong="chunk")
    whole = [tokenizer.bos_token_id, *tokenizer(text)["input_ids"], tokenizer.eos_token_id]
    ids = [examples[i]["input_ids"] for i in range(len(examples))]
    assert ids[1:4] == [whole[:16], whole[16:32], whole[32:]] and len(whole) == 39
    assert [len(row) for row in ids] == [4, 16, 16, 7, 16]  # the 17th token of "c"*15's row, alone, has no target
    assert all(examples[i]["labels"] == ids[i] for i in range(len(ids)))
    assert (stats.samples_in, stats.samples_out, stats.chunked, stats.truncated) == (3, 5, 2, 0)
    assert stats.target_tokens == 3 + 15 + 15 + 6 + 15


def test_chunk_policy_refuses_formats_it_would_cut_apart(tokenizer):
    rows = rows_of([{"prompt": "reverse: ab\n", "response": "ba"}])
    with pytest.raises(DataConfigError, match="data.overlong=chunk"):
        build_examples(rows, tokenizer, fmt="prompt_response", max_seq_len=16, overlong="chunk")


def test_chunked_rows_pack_and_keep_every_token(tokenizer):
    rows = rows_of([{"text": "x" * 50}, {"text": "y" * 5}])
    packed, _ = build_examples(rows, tokenizer, fmt="text", max_seq_len=20, overlong="chunk", packing=True)
    tokens = sorted(t for i in range(len(packed)) for t in packed[i]["input_ids"])
    texts = tokenizer("x" * 50)["input_ids"] + tokenizer("y" * 5)["input_ids"]
    assert tokens == sorted(texts + 2 * [tokenizer.bos_token_id, tokenizer.eos_token_id])
    assert all(len(packed[i]["input_ids"]) <= 20 for i in range(len(packed)))


def test_samples_without_targets_are_dropped_and_counted(tokenizer):
    rows = rows_of([
        {"messages": [{"role": "user", "content": "no reply"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ])
    examples, stats = build_examples(rows, tokenizer, fmt="messages", max_seq_len=64)
    assert (stats.samples_out, stats.dropped_no_target, stats.dropped_overlong) == (1, 1, 0)
    assert len(examples) == 1 and target_runs(tokenizer, examples[0]) == ["yo<|end|>"]


def test_no_sample_left_is_a_config_error(tokenizer):
    rows = rows_of([{"prompt": "reverse: abcdefgh\n", "response": "hgfedcba"}])
    with pytest.raises(DataConfigError, match="data.max_seq_len"):
        build_examples(rows, tokenizer, fmt="prompt_response", max_seq_len=8)


def test_missing_column_names_the_field_the_column_and_the_columns_found(tokenizer):
    rows = rows_of([{"question": "q", "answer": "a"}])
    with pytest.raises(DataConfigError) as error:
        build_examples(rows, tokenizer, fmt="prompt_response", max_seq_len=64)
    message = str(error.value)
    assert "data.format" in message and "'prompt'" in message and "question" in message and "answer" in message
    with pytest.raises(DataConfigError, match="data.format.*'messages'"):
        check_columns(["text"], "messages")
    with pytest.raises(DataConfigError, match="data.format"):
        check_columns(["text"], "chat")


def test_a_column_carrying_a_preference_signal_is_never_dropped_unread(tokenizer):
    """Unpaired completions (KTO's prompt, completion, label) read as prompt_response would train on the undesirable
    completions too: refused, naming the column, the format that reads it and both fixes; with the column ignored on
    purpose they train. Metadata no format reads (ids, scores) and a pair's conversation kept beside it pass."""
    rows = rows_of([{"prompt": "reverse: ab\n", "completion": "ba", "label": True},
                    {"prompt": "reverse: ab\n", "completion": "ab", "label": False}])
    with pytest.raises(DataConfigError) as error:
        build_examples(rows, tokenizer, fmt="prompt_response", max_seq_len=64)
    message = str(error.value)
    assert "['label']" in message and "data.format=unpaired" in message and "data.ignore_columns=[label]" in message
    _, stats = build_examples(rows, tokenizer, fmt="prompt_response", max_seq_len=64, ignore_columns=("label",))
    assert stats.samples_out == 2
    with pytest.raises(DataConfigError, match=r"\['margin', 'rejected'\].*preference"):
        check_columns(["prompt", "completion", "label", "rejected", "margin"], "unpaired")
    check_columns(["prompt", "chosen", "rejected", "messages", "prompt_id", "score_chosen"], "preference")
    check_columns(["prompt", "prompt_id", "messages"], "messages")


def test_messages_without_a_chat_template_is_a_config_error(tokenizer):
    no_template = copy.deepcopy(tokenizer)
    no_template.chat_template = None
    rows = rows_of([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    with pytest.raises(DataConfigError, match="chat template.*model.tokenizer"):
        build_examples(rows, no_template, fmt="messages", max_seq_len=64)


def test_template_that_is_not_incremental_is_a_config_error(tokenizer):
    odd = copy.deepcopy(tokenizer)
    # The last message renders differently, so a prefix rendering is not a prefix of the whole.
    odd.chat_template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}A: {% endif %}"
    )
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    with pytest.raises(DataConfigError, match="prefix"):
        FORMATS["messages"](row, odd)


def test_messages_with_tools_train_on_the_call_and_the_answer_never_the_tool_result(tokenizer):
    """A tool-call trace (llmtrain/tasks/lookup.py's, read from the shipped JSONL as a run reads it): the `tools`
    column is rendered into the prompt exactly as the tool-calling rollout renders ppo.tools, and the targets are the
    assistant's two turns (the call, the answer), not the tool's result."""
    from llmtrain.paths import ASSETS_DIR
    from llmtrain.stages.ppo.tools.parsing import prompt_ids
    from llmtrain.tasks.lookup import code_of, lookup

    row = datasets.load_dataset("json", data_files=str(ASSETS_DIR / "data/lookup_traces_eval.jsonl"), split="train")[0]
    key = row["messages"][0]["content"].removeprefix("code of ")
    encoded = FORMATS["messages"](row, tokenizer)
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "' + key + '"}}\n</tool_call><|end|>'
    assert target_runs(tokenizer, encoded) == [call, f"{code_of(key)}<|end|>"]
    assert f"<tool_response>\n{code_of(key)}\n</tool_response>" in context_text(tokenizer, encoded)
    rollout_prompt = prompt_ids(tokenizer, row["messages"][:1], [lookup])  # what tool_tiny's rollouts continue
    assert encoded["input_ids"][:len(rollout_prompt)] == rollout_prompt
    assert encoded["labels"][:len(rollout_prompt)] == [IGNORE_INDEX] * len(rollout_prompt)
    assert '"name": "lookup"' in tokenizer.decode(rollout_prompt)


@pytest.mark.parametrize("tools", ["not json", '{"name": "f"}', 3])
def test_a_tools_column_that_is_not_a_list_of_schemas_is_a_config_error(tokenizer, tools):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "tools": tools}
    with pytest.raises(DataConfigError, match="`tools` column"):
        FORMATS["messages"](row, tokenizer)
