"""dpo.precompute_ref_logps: the frozen reference's log-probs of every pair, computed once, kept beside the run.

Before the first step every rank runs the reference over its share of the training and held-out pairs (in
micro-batches as training collates them, every rank the same number of batches: a sharded reference needs every
rank in its collectives); the ranks' results are gathered and rank 0 writes `<output_dir>/ref_logps.pt` (to a
temporary name, then renamed). The reference engine is then dropped, and a resumed run reads the file instead of
building the reference at all. A pair is keyed by its tokens and labels (blake2b), so a table never answers for
other data: a pair the table lacks stops the run with the fix. The values equal the in-step reference's up to the
rounding of a different batch shape (fp32: ~1e-7 relative).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

CACHE_FILE = "ref_logps.pt"


def pair_key(example: dict) -> str:
    """A preference example's tokens and labels (chosen, then rejected) -> a hex digest."""
    digest = hashlib.blake2b(digest_size=16)
    for name in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
        digest.update(torch.tensor(example[name], dtype=torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


class ReferenceCache:
    """key -> (chosen, rejected) reference log-probs (fp32 values, as the reference produced them)."""

    def __init__(self, table: dict[str, tuple[float, float]], meta: dict):
        self.table, self.meta = table, meta

    def lookup(self, keys: tuple[str, ...], weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys and weight (P,) of a batch -> chosen (P,), rejected (P,) on weight's device (0 for a filler pair)."""
        values = []
        for key, real in zip(keys, weight.tolist()):
            if real and key not in self.table:
                field = self.meta.get("field", "dpo.precompute_ref_logps")  # kto's table names its own field
                raise KeyError(f"{field}: a pair of this run's data is not in {CACHE_FILE} (the data or its "
                               "tokenization changed since it was computed): delete the file to compute it again, or "
                               f"set {field}=false")
            values.append(self.table.get(key, (0.0, 0.0)))
        both = torch.tensor(values, dtype=torch.float32, device=weight.device).view(-1, 2)  # (P, 2)
        return both[:, 0], both[:, 1]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"meta": self.meta, "table": self.table}, tmp)
        os.replace(tmp, path)


def load_cache(path: Path, meta: dict) -> ReferenceCache | None:
    """The table at `path` when it was made for `meta` (the reference, summed or averaged log-probs), else None."""
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    if saved["meta"] != meta:
        log.warning("%s was computed for %s, this run is %s: computing the reference log-probs again",
                    path, saved["meta"], meta)
        return None
    return ReferenceCache(saved["table"], meta)


def compute_cache(reference_logps: Callable, batches: Iterable, meta: dict, path: Path,
                  is_main: bool) -> ReferenceCache:
    """Run `reference_logps(batch) -> (chosen (P,), rejected (P,))` over this rank's batches, gather every rank's
    table, write it (rank 0) and return it on every rank."""
    local: dict[str, tuple[float, float]] = {}
    for batch in batches:
        chosen, rejected = reference_logps(batch)
        for key, real, c, r in zip(batch.keys, batch.weight.tolist(), chosen.tolist(), rejected.tolist()):
            if real:
                local[key] = (c, r)
    tables = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        tables = [None] * dist.get_world_size()
        dist.all_gather_object(tables, local)
    cache = ReferenceCache({key: value for table in tables for key, value in table.items()}, meta)
    if is_main:
        cache.save(path)
        log.info("reference log-probs of %d pairs written to %s; the reference role is released",
                 len(cache.table), path)
    if dist.is_initialized():
        dist.barrier()
    return cache
