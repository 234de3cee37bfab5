"""The step sampler's windows and the lr schedule, against hand-derived expectations."""

import math

import pytest
import torch

from llmtrain.backends.base import lr_factor, param_groups
from llmtrain.data.sampler import StepBatchSampler


def step_union(num_examples, step, micro, accum, dp, seed=7, lengths=None):
    chosen = []
    for rank in range(dp):
        sampler = StepBatchSampler(num_examples, micro_batch_size=micro, grad_accum_steps=accum, dp_rank=rank,
                                   dp_size=dp, seed=seed, lengths=lengths)
        micro_batches = sampler.micro_batches(step)
        assert len(micro_batches) == accum and all(len(mb) == micro for mb in micro_batches)
        chosen += [i for mb in micro_batches for i in mb]
    return chosen


@pytest.mark.parametrize("micro,accum,dp", [(8, 1, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 8, 1)])
def test_every_split_of_a_global_batch_sees_the_same_examples(micro, accum, dp):
    for step in range(5):  # 100 // 8 = 12 steps per epoch
        reference = torch.randperm(100, generator=torch.Generator().manual_seed(7))[step * 8:(step + 1) * 8]
        assert sorted(step_union(100, step, micro, accum, dp)) == sorted(reference.tolist())


def test_ranks_are_disjoint_and_epochs_roll_over_with_a_new_order():
    steps_per_epoch = 100 // 8
    seen = [i for step in range(steps_per_epoch) for i in step_union(100, step, 2, 2, 2)]
    assert len(seen) == len(set(seen)) == 96
    next_epoch = torch.randperm(100, generator=torch.Generator().manual_seed(8))[:8].tolist()
    assert sorted(step_union(100, steps_per_epoch, 2, 2, 2)) == sorted(next_epoch)


LENGTHS = torch.randint(5, 500, (1000,), generator=torch.Generator().manual_seed(0)).tolist()


def padded_tokens(micro_batches_per_step, lengths) -> int:
    return sum(len(mb) * max(lengths[i] for i in mb) for step in micro_batches_per_step for mb in step)


def test_group_by_length_cuts_padding_and_keeps_every_sampler_property():
    steps = 1000 // 16
    grouped = [StepBatchSampler(1000, micro_batch_size=4, grad_accum_steps=2, dp_rank=r, dp_size=2, seed=7,
                                lengths=LENGTHS) for r in range(2)]
    plain = [StepBatchSampler(1000, micro_batch_size=4, grad_accum_steps=2, dp_rank=r, dp_size=2, seed=7)
             for r in range(2)]
    by_step = [[mb for s in samplers for mb in s.micro_batches(step)] for samplers in (grouped, plain)
               for step in range(steps)]
    grouped_steps, plain_steps = by_step[:steps], by_step[steps:]
    real = sum(LENGTHS[i] for step in grouped_steps for mb in step for i in mb)
    assert real == sum(LENGTHS[i] for step in plain_steps for mb in step for i in mb)  # the same examples
    assert padded_tokens(grouped_steps, LENGTHS) < 1.1 * real < padded_tokens(plain_steps, LENGTHS)
    seen = [i for step in grouped_steps for mb in step for i in mb]
    assert len(seen) == len(set(seen)) == steps * 16  # each example at most once per epoch
    assert max(LENGTHS[i] for mb in grouped_steps[0] for i in mb) == max(LENGTHS[i] for i in seen)  # longest first
    for micro, accum, dp in [(16, 1, 1), (2, 4, 2), (1, 4, 4)]:  # the window depends on G alone
        for step in (0, 5, steps + 3):
            assert sorted(step_union(1000, step, micro, accum, dp, lengths=LENGTHS)) == \
                sorted(step_union(1000, step, 8, 2, 1, lengths=LENGTHS))
    resumed = StepBatchSampler(1000, micro_batch_size=4, grad_accum_steps=2, dp_rank=1, dp_size=2, seed=7,
                               lengths=LENGTHS, start_step=steps + 2)
    assert next(iter(resumed)) == grouped[1].micro_batches(steps + 2)[0]


def test_resume_position_is_the_step_count():
    fresh = StepBatchSampler(50, micro_batch_size=2, grad_accum_steps=3, dp_rank=1, dp_size=2, seed=3)
    resumed = StepBatchSampler(50, micro_batch_size=2, grad_accum_steps=3, dp_rank=1, dp_size=2, seed=3, start_step=5)
    stream = iter(fresh)
    for _ in range(5 * 3):
        next(stream)
    assert [next(stream) for _ in range(9)] == [mb for mb, _ in zip(resumed, range(9))]


def test_dataset_smaller_than_a_global_batch_is_an_error():
    with pytest.raises(ValueError, match="trainer.micro_batch_size"):
        StepBatchSampler(5, micro_batch_size=4, grad_accum_steps=1, dp_rank=0, dp_size=2, seed=0)


def test_lr_schedules_by_hand():
    kw = dict(warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, schedule="cosine", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, schedule="cosine", **kw) == 1.0
    assert math.isclose(lr_factor(9, schedule="cosine", **kw), 0.1 + 0.9 * 0.5)  # half-way: cos(pi/2) = 0
    assert math.isclose(lr_factor(14, schedule="cosine", **kw), 0.1)
    assert math.isclose(lr_factor(9, schedule="linear", **kw), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_factor(6, schedule="linear", **kw), 0.1 + 0.9 * 0.8)
    assert lr_factor(13, schedule="constant", **kw) == 1.0


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])]
    assert sorted(p.numel() for p in no_decay["params"]) == [4, 4, 4] and no_decay["weight_decay"] == 0.0
