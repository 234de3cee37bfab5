"""The format registry and the unpaired examples KTO trains on: the `unpaired` format, preference pairs unpaired, the
KL sequences (each row's prompt with the previous row's completion), the collated KTO batch, and the config errors.

The shipped tokenizer is byte-level: one token per ASCII character, so texts are compared decoded."""

import datasets
import pytest
import torch

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.data.dataset import build_examples
from llmtrain.data.errors import DataConfigError
from llmtrain.data.formats import FORMAT_SPECS, check_columns
from llmtrain.data.unpaired_format import UNPAIRED_COLUMNS, pairs_of, prompt_length
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.stages.kto import collate_kto
from llmtrain.validation import validate


def text(tokenizer, ids, labels, targets: bool) -> str:
    """The decoded prompt (targets=False) or completion (True) of a sequence."""
    cut = prompt_length(labels)
    return tokenizer.decode(ids[cut:] if targets else ids[:cut], skip_special_tokens=True)


def test_every_format_is_one_registered_spec_with_its_columns_and_example_kind():
    assert set(FORMAT_SPECS) == {"text", "prompt_response", "alpaca", "messages", "preference", "unpaired"}
    assert {name: spec.example for name, spec in FORMAT_SPECS.items()} == {
        "text": "sequence", "prompt_response": "sequence", "alpaca": "sequence", "messages": "sequence",
        "preference": "pair", "unpaired": "unpaired"}
    assert FORMAT_SPECS["unpaired"].known_columns == ("completion", "label", "prompt")
    rows = FORMAT_SPECS["unpaired"].synthetic(40, seed=0)  # its tiny synthetic data
    assert {row["label"] for row in rows} == {True, False}
    assert all(row["completion"] == row["prompt"][len("reverse: "):-1][::-1] for row in rows if row["label"])


def test_unpaired_rows_keep_their_label_and_a_mismatched_kl_sequence(tokenizer):
    rows = {"prompt": ["reverse: abc\n", "reverse: hello\n", "reverse: xyz\n"],
            "completion": ["cba", "nope", "zyx"], "label": [True, False, True]}
    examples, stats = build_examples(datasets.Dataset.from_dict(rows), tokenizer, fmt="unpaired", max_seq_len=64)
    assert examples.columns == UNPAIRED_COLUMNS and stats.samples_out == 3 and len(examples) == 3
    items = [examples[i] for i in range(3)]
    assert [item["desirable"] for item in items] == [True, False, True]
    assert [item["pair"] for item in items] == [-1, -1, -1]
    for i, item in enumerate(items):
        assert text(tokenizer, item["input_ids"], item["labels"], False) == rows["prompt"][i]
        assert text(tokenizer, item["input_ids"], item["labels"], True) == rows["completion"][i]
        # the KL sequence: this row's prompt, the previous row's completion (row 0: the last row's)
        assert text(tokenizer, item["kl_input_ids"], item["kl_labels"], False) == rows["prompt"][i]
        assert text(tokenizer, item["kl_input_ids"], item["kl_labels"], True) == rows["completion"][i - 1]
        assert item["input_ids"][-1] == item["kl_input_ids"][-1] == tokenizer.eos_token_id


def test_preference_pairs_become_one_desirable_and_one_undesirable_row(tokenizer):
    rows = {"prompt": ["reverse: abc\n", "reverse: dog\n"], "chosen": ["cba", "god"], "rejected": ["abc", "cat"]}
    examples, stats = build_examples(datasets.Dataset.from_dict(rows), tokenizer, fmt="preference", max_seq_len=64,
                                     unpaired=True)
    assert stats.samples_out == 2 and len(examples) == 4
    items = [examples[i] for i in range(4)]  # every chosen, then every rejected: neighbours answer other prompts
    completions = [text(tokenizer, item["input_ids"], item["labels"], True) for item in items]
    assert completions == ["cba", "god", "abc", "cat"]
    assert [item["desirable"] for item in items] == [True, True, False, False]
    assert [item["pair"] for item in items] == [0, 1, 0, 1]
    kl_completions = [text(tokenizer, item["kl_input_ids"], item["kl_labels"], True) for item in items]
    assert kl_completions == ["cat", "cba", "god", "abc"]
    pairs, _ = build_examples(datasets.Dataset.from_dict(rows), tokenizer, fmt="preference", max_seq_len=64)
    assert pairs_of(examples) == [{k: pairs[i][k] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids",
                                                              "rejected_labels")} for i in range(2)]  # finished_run's


def test_an_overlong_kl_sequence_loses_prompt_tokens_after_the_bos(tokenizer):
    rows = {"prompt": ["p", "a much longer prompt\n"], "completion": ["a long completion here", "x"],
            "label": [True, False]}
    examples, _ = build_examples(datasets.Dataset.from_dict(rows), tokenizer, fmt="unpaired", max_seq_len=28)
    second = examples[1]  # its prompt (23 tokens with bos) + the first row's completion (23 with eos) > 28
    assert len(second["kl_input_ids"]) == 28 and second["kl_input_ids"][0] == second["input_ids"][0]
    assert text(tokenizer, second["kl_input_ids"], second["kl_labels"], True) == "a long completion here"


def test_the_unpaired_format_names_its_missing_column_and_sequences_are_refused(tokenizer):
    with pytest.raises(DataConfigError, match="data.format=unpaired needs a column 'label'"):
        check_columns(["prompt", "completion"], "unpaired")
    rows = datasets.Dataset.from_dict({"prompt": ["reverse: ab\n"], "response": ["ba"]})
    with pytest.raises(DataConfigError, match="unpaired completions need data.format=unpaired or preference"):
        build_examples(rows, tokenizer, fmt="prompt_response", max_seq_len=64, unpaired=True)


def test_collated_kto_batch_holds_completions_then_kl_sequences(tokenizer):
    rows = {"prompt": ["reverse: abc\n", "reverse: hello\n"], "completion": ["cba", "nope"], "label": [True, False]}
    examples, _ = build_examples(datasets.Dataset.from_dict(rows), tokenizer, fmt="unpaired", max_seq_len=64)
    items = [examples[0], examples[1]]
    batch = collate_kto(items, pad_token_id=tokenizer.pad_token_id, keyed=True)
    assert batch.desirable.tolist() == [True, False] and batch.num_pairs == 2 and len(batch.keys) == 2
    ids = batch.rows.input_ids  # (2N, T): rows 0..N-1 the completions, N..2N-1 their KL sequences
    for i, item in enumerate(items):
        assert ids[i, :len(item["input_ids"])].tolist() == item["input_ids"]
        assert ids[2 + i, :len(item["kl_input_ids"])].tolist() == item["kl_input_ids"]
    moved = batch.to("cpu")
    assert torch.equal(moved.desirable, batch.desirable) and type(moved).__name__ == "KTOBatch"
    packed = collate_kto(items, pad_token_id=tokenizer.pad_token_id, padding_free=True)
    assert packed.rows.input_ids.shape[0] == 1 and (packed.rows.labels != IGNORE_INDEX).sum() == \
        (batch.rows.labels != IGNORE_INDEX).sum()


@pytest.mark.parametrize("overrides, needle", [
    (["stage=dpo", "data.format=unpaired"], "stage dpo trains on pairs: data.format='unpaired' must be preference"),
    (["data=reverse"], "stage kto trains on completions marked desirable or undesirable: data.format="),
    (["kto.loss_type=sigmoid"], "kto.loss_type='sigmoid' is not one of kto, apo_zero_unpaired"),
    (["kto.undesirable_weight=0"], "kto.undesirable_weight=0"),
    (["backend=fsdp2", "backend.pp=2"], "set kto.precompute_ref_logps=true, or backend.pp=1"),
    (["data.packing=true"], "data.packing=false"),
])
def test_kto_config_errors_name_the_field_before_any_model_loads(overrides, needle):
    cfg = compose_config(["recipe=kto_tiny", *overrides])
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size=1)
    assert needle in str(error.value)
