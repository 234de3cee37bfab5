"""Pair batches cut into sequence shards (stages/pair_shard.py) without torchrun: each sequence's targets, log-prob
sums and target counts add up over the shards to the whole row's, each last token (the reward model's score) is on
exactly one shard at the right place, and each pair is counted by one shard. (The sums over real sp peers, their
gradients and whole runs: tests/dist/test_sequence_parallel.py.)"""

import pytest
import torch

from llmtrain.data.sequence_shard import RowShare
from llmtrain.losses.dpo import owned_sums, sequence_sums
from llmtrain.losses.lm import IGNORE_INDEX
from llmtrain.stages.orpo import collate_orpo_pairs
from llmtrain.stages.preference import collate_pairs


def _pair(prompt: int, chosen: int, rejected: int, start: int) -> dict:
    """A preference example: `prompt` loss-free tokens, then a reply of `chosen` / `rejected` target tokens."""
    def side(reply, offset):
        ids = [(start + offset + 3 * i) % 50 + 1 for i in range(prompt + reply)]
        return ids, [IGNORE_INDEX] * prompt + ids[prompt:]

    (c_ids, c_labels), (r_ids, r_labels) = side(chosen, 0), side(rejected, 7)
    return {"chosen_input_ids": c_ids, "chosen_labels": c_labels, "rejected_input_ids": r_ids,
            "rejected_labels": r_labels}


EXAMPLES = [_pair(3, 4, 2, 0), _pair(2, 5, 3, 11), _pair(4, 1, 6, 23)]  # 2P = 6 sequences, lengths 7 6 7 7 5 10


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("sp", [2, 3])
def test_shards_add_up_to_the_whole_sequences(padding_free, sp):
    batch = collate_pairs(EXAMPLES, pad_token_id=0, padding_free=padding_free)
    shards = [batch.sequence_shard("sdpa_segments", RowShare(rank, sp)) for rank in range(sp)]
    torch.manual_seed(0)
    width = shards[0].rows.width * sp
    logps = torch.randn(batch.rows.input_ids.shape[0], width)  # (R, W): a log-prob at every padded position
    whole = sequence_sums(logps[:, :batch.rows.width], batch.rows.labels, batch.sequence_ids, batch.num_sequences)
    counts = torch.tensor([float(sum(label != IGNORE_INDEX for label in e[f"{side}_labels"][1:]))
                           for side in ("chosen", "rejected") for e in EXAMPLES])  # (2P,) by hand: after the shift
    local = width // sp
    parts = [owned_sums(logps[:, r * local:(r + 1) * local], s.rows.targets(), s.target_owners(), s.num_sequences)
             for r, s in enumerate(shards)]
    assert torch.allclose(sum(p[0] for p in parts), whole, rtol=1e-6)
    assert torch.equal(sum(p[1] for p in parts), counts)
    assert torch.equal(owned_sums(logps[:, :batch.rows.width], batch.rows.targets(), batch.target_owners(),
                                  batch.num_sequences)[1], counts)  # the unsharded batch reads the same way


@pytest.mark.parametrize("padding_free", [True, False])
def test_each_last_token_lives_on_one_shard_at_its_place(padding_free):
    batch, sp = collate_pairs(EXAMPLES, pad_token_id=0, padding_free=padding_free), 2
    shards = [batch.sequence_shard("sdpa_segments", RowShare(rank, sp)) for rank in range(sp)]
    whole_ids = batch.rows.input_ids.flatten()[batch.ends]  # (2P,) each sequence's last token
    holders = torch.stack([s.ends >= 0 for s in shards])  # (sp, 2P)
    assert torch.equal(holders.sum(0), torch.ones(batch.num_sequences, dtype=torch.long))
    assert holders[1].any() and holders[0].any()  # some scores are read on the second sp rank
    for shard in shards:
        here = shard.ends >= 0
        assert torch.equal(shard.rows.input_ids.flatten()[shard.ends[here]], whole_ids[here])


def test_pairs_are_counted_on_sp_rank_0_only():
    batch = collate_orpo_pairs(EXAMPLES, pad_token_id=0, padding_free=True)
    shards = [batch.sequence_shard("sdpa_segments", RowShare(rank, 2)) for rank in range(2)]
    assert [s.share for s in shards] == [1.0, 0.0]
    assert [s.num_pairs for s in shards] == [3, 0]
    assert [s.num_chosen_targets for s in shards] == [4 + 5 + 1, 0]  # the chosen replies' targets, on rank 0
    assert torch.equal(shards[0].counted, batch.weight) and not shards[1].counted.any()
    assert all(s.keys == batch.keys and torch.equal(s.margin, batch.margin) for s in shards)
    with pytest.raises(ValueError, match="already a shard"):
        shards[0].sequence_shard("sdpa_segments", RowShare(0, 2))
