"""DAPO's dynamic sampling (stages/ppo/filtering.py): which groups are kept, and rounds of different widths joined."""

from __future__ import annotations

from dataclasses import fields

import torch

from llmtrain.stages.ppo.experience import Experience
from llmtrain.stages.ppo.filtering import chosen_groups, concat_experiences, group_rows, varied_groups


def test_a_group_is_varied_when_any_two_scores_differ():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2 + 1e-7])
    assert varied_groups(scores, 3).tolist() == [False, True, True]


def test_unscored_rows_do_not_make_a_group_varied():
    """NaN: no reward function scored the row (it is out of its group's statistics, advantage 0): only the scored
    rows of a group can differ."""
    nan = float("nan")
    scores = torch.tensor([1.0, nan, 1.0, 0.0, nan, 1.0, nan, nan, 2.0, nan, nan, nan])
    assert varied_groups(scores, 3).tolist() == [False, True, False, False]


def test_the_first_varied_groups_are_kept_in_order():
    varied = torch.tensor([False, True, True, False, True, True])
    kept, topped_up = chosen_groups(varied, 3)
    assert kept.tolist() == [1, 2, 4] and topped_up == 0


def test_too_few_varied_groups_are_topped_up_with_the_earliest_uniform_ones():
    varied = torch.tensor([False, True, False, False])
    kept, topped_up = chosen_groups(varied, 3)
    assert kept.tolist() == [0, 1, 2] and topped_up == 2


def test_group_rows_are_the_groups_consecutive_samples():
    assert group_rows(torch.tensor([0, 2]), 3).tolist() == [0, 1, 2, 6, 7, 8]


def _experience(prompt_width: int, actions: int, rows: int, start: int) -> Experience:
    """Rows whose every token and value is distinct: start, start + 1, ..."""
    width = prompt_width + actions
    ids = torch.arange(start, start + rows * width).view(rows, width)
    per_action = torch.arange(rows * actions, dtype=torch.float32).view(rows, actions) + start
    values = {f.name: per_action.clone() for f in fields(Experience)}
    values.update(sequences=ids, attention_mask=torch.ones(rows, width, dtype=torch.long),
                  action_mask=torch.ones(rows, actions, dtype=torch.bool), scores=torch.arange(rows) + float(start),
                  ended=torch.ones(rows, dtype=torch.bool))
    return Experience(**values)


def test_rounds_of_different_widths_join_with_prompts_left_and_responses_right_padded():
    first, second = _experience(3, 2, rows=2, start=0), _experience(1, 4, rows=1, start=100)
    joined = concat_experiences([first, second], pad_token_id=-1)
    assert joined.sequences.shape == (3, 3 + 4) and joined.num_actions == 4
    # the first round: prompts as they were, two response columns of padding after its actions
    assert joined.sequences[0].tolist() == [*first.sequences[0].tolist(), -1, -1]
    assert joined.attention_mask[0].tolist() == [1] * 5 + [0, 0]
    assert joined.action_mask[0].tolist() == [True, True, False, False]
    assert joined.advantages[0].tolist() == [*first.advantages[0].tolist(), 0.0, 0.0]
    # the second: two prompt columns of left padding, its actions aligned with the first round's
    assert joined.sequences[2].tolist() == [-1, -1, *second.sequences[0].tolist()]
    assert joined.attention_mask[2].tolist() == [0, 0] + [1] * 5
    assert joined.action_mask[2].tolist() == [True] * 4
    assert joined.scores.tolist() == [0.0, 1.0, 100.0]
    # the action columns still end the sequence: responses are the last num_actions tokens of every row
    assert joined.sequences[:, -4:][2].tolist() == second.sequences[0, -4:].tolist()
    assert concat_experiences([first], pad_token_id=-1) is first
