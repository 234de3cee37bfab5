"""dpo.precompute_ref_logps's table (stages/reference_cache.py): keyed by a pair's tokens and labels, made for one
reference, and a pair it lacks is an error that names the fix."""

from __future__ import annotations

import pytest
import torch

from llmtrain.stages.reference_cache import ReferenceCache, load_cache, pair_key

PAIR = {"chosen_input_ids": [1, 2, 3], "chosen_labels": [-100, 2, 3], "rejected_input_ids": [1, 2, 4],
        "rejected_labels": [-100, 2, 4]}


def test_a_pair_key_changes_with_any_token_or_label():
    assert pair_key(PAIR) == pair_key(dict(PAIR))
    assert pair_key({**PAIR, "rejected_labels": [-100, -100, 4]}) != pair_key(PAIR)
    assert pair_key({**PAIR, "chosen_input_ids": [1, 2, 5]}) != pair_key(PAIR)
    # the sides are not interchangeable, nor is a token moved across the boundary between fields
    assert pair_key({**PAIR, "chosen_input_ids": [1, 2], "chosen_labels": [-100, 2, 3, 3]}) != pair_key(PAIR)


def test_the_table_round_trips_fp32_values_exactly_and_only_for_its_reference(tmp_path):
    values = torch.tensor([-3.1415927, -2.7182817], dtype=torch.float32)
    meta = {"reference": "ModelSource(name_or_path='a')", "averaged": False}
    ReferenceCache({pair_key(PAIR): tuple(values.tolist())}, meta).save(tmp_path / "ref_logps.pt")
    cache = load_cache(tmp_path / "ref_logps.pt", meta)
    chosen, rejected = cache.lookup((pair_key(PAIR), "filler"), torch.tensor([1.0, 0.0]))
    assert torch.equal(torch.stack([chosen[0], rejected[0]]), values) and chosen[1] == 0 == rejected[1]
    assert load_cache(tmp_path / "ref_logps.pt", {**meta, "averaged": True}) is None  # IPO averages: recompute
    assert load_cache(tmp_path / "missing.pt", meta) is None
    with pytest.raises(KeyError, match="not in ref_logps.pt .* delete the file .* dpo.precompute_ref_logps=false"):
        cache.lookup(("another pair",), torch.tensor([1.0]))
