"""Where rows come from: local files or a `datasets` name, and a seeded train/eval split."""

from pathlib import Path

import datasets
import numpy as np

from llmtrain.data.errors import DataConfigError

BUILDER_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_rows(
    files: list[str] | None,
    dataset: str | None,
    split: str = "train",
    *,
    files_field: str = "data.train_files",
) -> datasets.Dataset:
    """Rows from local files (`files`) or a dataset name / `save_to_disk` directory (`dataset`).

    Exactly one of the two must be given. `files_field` is the config field named in errors
    (pass "data.eval_files" when loading eval files).
    """
    if bool(files) == bool(dataset):
        raise DataConfigError(
            f"set exactly one of {files_field} (local .jsonl/.json/.parquet files) or data.dataset "
            f"(a datasets name or a save_to_disk directory); got files={files!r}, dataset={dataset!r}"
        )
    if files:
        return _load_files(list(files), files_field)
    return _load_named(dataset, split)


def _load_files(files: list[str], field: str) -> datasets.Dataset:
    builder = _builder_for(files, field)
    for path in files:
        if not Path(path).is_file():
            raise DataConfigError(f"{field}: file not found: {path} (check the path; relative paths "
                                  f"are resolved from the working directory {Path.cwd()})")
    return datasets.load_dataset(builder, data_files=files, split="train")


def _builder_for(files: list[str], field: str) -> str:
    suffixes = {Path(path).suffix.lower() for path in files}
    unknown = sorted(suffixes - BUILDER_BY_SUFFIX.keys())
    if unknown:
        raise DataConfigError(f"{field}: unsupported file type {unknown}; use "
                              f"{sorted(BUILDER_BY_SUFFIX)} files")
    builders = {BUILDER_BY_SUFFIX[suffix] for suffix in suffixes}
    if len(builders) > 1:
        raise DataConfigError(f"{field}: mixes json and parquet files; convert them to one type")
    return builders.pop()


def _load_named(name: str, split: str) -> datasets.Dataset:
    if Path(name).is_dir() and _is_saved_to_disk(Path(name)):
        return _load_saved(name, split)
    try:
        return datasets.load_dataset(name, split=split)
    except (OSError, ValueError) as err:  # not found, offline hub, unknown split
        raise DataConfigError(f"data.dataset: cannot load {name!r} split {split!r} ({err}); give "
                              f"a local save_to_disk directory or files in data.train_files") from err


def _is_saved_to_disk(path: Path) -> bool:
    # save_to_disk writes state.json for a Dataset and dataset_dict.json for a DatasetDict
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _load_saved(path: str, split: str) -> datasets.Dataset:
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataConfigError(f"data.dataset: {path} has splits {sorted(loaded)}, not {split!r}; "
                                  f"set the split to one of them")
        return loaded[split]
    return loaded


def split_eval(
    rows: datasets.Dataset, fraction: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Deterministic seeded split into (train_rows, eval_rows); both keep the original row order."""
    if not 0.0 < fraction < 1.0:
        raise DataConfigError(f"data.eval_fraction must be in (0, 1), got {fraction}")
    num_eval = max(1, round(len(rows) * fraction))
    if num_eval >= len(rows):
        raise DataConfigError(f"data.eval_fraction={fraction} leaves no training rows out of "
                              f"{len(rows)}; lower it or give eval files")
    order = np.random.default_rng(seed).permutation(len(rows))
    eval_indices = np.sort(order[:num_eval])
    train_indices = np.sort(order[num_eval:])
    return rows.select(train_indices), rows.select(eval_indices)
