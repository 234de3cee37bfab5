"""Two gloo ranks in one unit test (tests/unit/test_ppo_stage.py, torch.multiprocessing.spawn): each scores its own
responses with reward functions and writes what `combined_scores` gave it, so the test compares every rank's
per-function means with the global ones."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import torch.distributed as dist

RESPONSES = (["ab", "abcd"], ["abcdef"])  # rank 0's, rank 1's


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def only_short(completions, **kwargs):
    return [1.0 if len(c) < 3 else None for c in completions]  # rank 1 has no short response: none scored there


def never(completions, **kwargs):
    return [math.nan] * len(completions)


def score(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from llmtrain.stages.ppo.rewards import Completions, RewardFunction, combined_scores, score_metrics

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        texts = RESPONSES[rank]
        completions = Completions(prompts=["p"] * len(texts), texts=texts, ids=[[0]] * len(texts), columns={})
        functions = [RewardFunction("my_rewards:length", length, 0.5),
                     RewardFunction("my_rewards:only_short", only_short, 2.0)]
        totals, means = combined_scores(functions, completions)
        try:
            combined_scores([RewardFunction("my_rewards:never", never)], completions)
            error = None
        except ValueError as e:  # on every rank, after the all-reduce: no rank waits for the other
            error = str(e)
        record = {"totals": totals, "means": means, "metrics": score_metrics(functions, means), "error": error}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()
