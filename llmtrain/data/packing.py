"""Packing: several samples share one row of at most max_seq_len tokens.

A packed row stays equivalent to its samples run one by one only if (1) attention cannot cross
sample boundaries (per-sample attention from the sample lengths, see `collate.Batch.for_attention`;
resetting position ids alone does NOT isolate samples in transformers 5), (2) positions restart at 0
per sample, and (3) no loss is taken for predicting a sample's first token from the previous
sample's last token.
"""

import bisect

from llmtrain.losses.lm import IGNORE_INDEX


def pack_best_fit(lengths: list[int], max_seq_len: int) -> list[list[int]]:
    """Index groups, each row as full as possible: best-fit decreasing.

    Longest sample first, each into the fullest row it still fits in (a new row when none has room).
    Rows hold their samples in index order and come out in order of their first sample, so the plan is
    a pure function of the lengths; the sampler shuffles rows, so no visiting order is lost. On the
    benchmark's log-normal SFT lengths rows are 99.5 % full where next-fit in dataset order left 82.5 %.
    """
    free: list[tuple[int, int]] = []  # (space left, row), sorted: the best fit is the first with room
    rows: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > max_seq_len:
            raise ValueError(f"sample {index} has {length} tokens > max_seq_len={max_seq_len}; "
                             f"apply the over-long policy before packing")
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            rows.append([index])
            space, row = max_seq_len, len(rows) - 1
        else:
            space, row = free.pop(at)
            rows[row].append(index)
        bisect.insort(free, (space - length, row))
    return sorted((sorted(row) for row in rows), key=lambda row: row[0])


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
