"""Which examples each rank trains on at each optimizer step: a pure function of the step number.

Epoch e visits the examples in `randperm(N)` seeded with seed + e; optimizer step s (0-based within
the epoch) takes the window perm[s·G : (s+1)·G] of G = micro × accum × dp examples, rank r takes
every dp-th example of the window (DistributedSampler semantics), and its accum micro-batches are
consecutive slices. The union of a step's examples is the same window for any (dp, micro, accum)
with the same G, so 2 ranks × b equals 1 rank × 2b. Resume needs only the step count, so the
position never depends on data.num_workers. The incomplete last window of an epoch is dropped.

With `lengths` (data.group_by_length) the epoch's order is regrouped so each window holds examples
of similar length, as HF Trainer's `group_by_length` does: the permutation is cut into megabatches of
MEGABATCH_WINDOWS windows, each sorted by length (longest first) and cut back into windows, and the
windows are shuffled, the one with the longest example first (too little memory shows at step 1,
not hours in). Less padding per micro-batch; still a pure function of (seed, epoch, lengths)
and of G alone, so every property above holds.
"""

from __future__ import annotations

from itertools import count
from typing import Iterator

import torch

MEGABATCH_WINDOWS = 50  # windows sorted together: larger groups lengths better, randomises less


class StepBatchSampler:
    def __init__(self, num_examples: int, *, micro_batch_size: int, grad_accum_steps: int,
                 dp_rank: int, dp_size: int, seed: int, start_step: int = 0, lengths: list[int] | None = None):
        self.global_batch = micro_batch_size * grad_accum_steps * dp_size
        if num_examples < self.global_batch:
            raise ValueError(
                f"the training set has {num_examples} examples after processing, fewer than one global batch "
                f"({self.global_batch} = trainer.micro_batch_size × trainer.grad_accum_steps × dp): "
                "add data or lower the batch size")
        self.num_examples = num_examples
        self.micro_batch_size, self.grad_accum_steps = micro_batch_size, grad_accum_steps
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.start_step = start_step
        self.lengths = None if lengths is None else torch.tensor(lengths)
        self.steps_per_epoch = num_examples // self.global_batch
        self._cached_epoch, self._cached_perm = -1, None

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._cached_epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_examples, generator=generator)
            self._cached_perm = perm if self.lengths is None else self._grouped_by_length(perm, generator)
            self._cached_epoch = epoch
        return self._cached_perm

    def _grouped_by_length(self, perm: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        usable = self.steps_per_epoch * self.global_batch  # the dropped tail stays dropped
        megabatch = MEGABATCH_WINDOWS * self.global_batch
        sorted_chunks = [chunk[self.lengths[chunk].argsort(descending=True, stable=True)]
                         for chunk in perm[:usable].split(megabatch)]
        windows = torch.cat(sorted_chunks).view(self.steps_per_epoch, self.global_batch)  # (steps, G)
        order = torch.randperm(self.steps_per_epoch, generator=generator)
        longest = int(self.lengths[windows[:, 0]].argmax())  # its window goes first: an OOM shows at once
        order = torch.cat([order[order == longest], order[order != longest]])
        return windows[order].flatten()

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches (example indices) for the step with 0-based index `step`."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        start = step_in_epoch * self.global_batch
        window = self._permutation(epoch)[start:start + self.global_batch]
        mine = window[self.dp_rank::self.dp_size].tolist()
        b = self.micro_batch_size
        return [mine[i:i + b] for i in range(0, len(mine), b)]

    def __iter__(self) -> Iterator[list[int]]:
        for step in count(self.start_step):
            yield from self.micro_batches(step)
