"""Packing: several samples share one row of at most max_seq_len tokens.

A packed row stays equivalent to its samples run one by one only if (1) attention cannot cross
sample boundaries (the block-diagonal mask built in `collate`; resetting position ids alone does
NOT isolate samples in transformers 5), (2) positions restart at 0 per sample, and (3) no loss
is taken for predicting a sample's first token from the previous sample's last token.
"""

from llmtrain.losses.lm import IGNORE_INDEX


def pack_greedy(lengths: list[int], max_seq_len: int) -> list[list[int]]:
    """Index groups in dataset order: each sample joins the open row while it fits (next-fit).

    In-order rather than first-fit-decreasing, so a packed epoch visits samples in the same order
    as an unpacked one and the plan is a pure function of the lengths.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, length in enumerate(lengths):
        if length > max_seq_len:
            raise ValueError(f"sample {index} has {length} tokens > max_seq_len={max_seq_len}; "
                             f"apply the over-long policy before packing")
        if current and used + length > max_seq_len:
            groups.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        groups.append(current)
    return groups


def merge_packed(examples: list[dict]) -> dict:
    """One packed row from samples with `input_ids` and aligned `labels`.

    Returns input_ids, labels, position_ids (restarting at 0 per sample) and seq_lens.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    seq_lens: list[int] = []
    for example in examples:
        length = len(example["input_ids"])
        if length == 0:
            raise ValueError("cannot pack an empty sample; empty samples are dropped before packing")
        sample_labels = list(example["labels"])
        # The shifted loss would predict this token from the previous sample's last token;
        # unpacked, label 0 is never a target, so masking it keeps packed loss == unpacked loss.
        sample_labels[0] = IGNORE_INDEX
        input_ids.extend(example["input_ids"])
        labels.extend(sample_labels)
        position_ids.extend(range(length))
        seq_lens.append(length)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "seq_lens": seq_lens}
