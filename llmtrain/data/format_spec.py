"""A data format as one spec: its columns, what one encoded row is, its encoder and its tiny synthetic data.

Each format module declares `DATA_FORMATS = (DataFormat(...),)`; `formats.FORMAT_SPECS` collects them (the registry
the dataset, the validator and the stages read). A stage names the formats it trains on (`StageSpec.data_formats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

EXAMPLE_KINDS = ("sequence", "pair", "unpaired")


@dataclass(frozen=True)
class DataFormat:
    name: str
    columns: tuple[tuple[str, ...], ...]  # the columns it needs, each as its accepted names
    encode: Callable  # (row, tokenizer, max_seq_len, overlong) -> {ids..., "outcome"}
    optional: tuple[str, ...] = ()  # columns read when present
    example: str = "sequence"  # one encoded row: a sequence | a chosen/rejected pair | an unpaired completion
    synthetic: Callable | None = None  # (n, seed) -> rows of its tiny synthetic data

    @property
    def known_columns(self) -> tuple[str, ...]:
        return (*(name for accepted in self.columns for name in accepted), *self.optional)
