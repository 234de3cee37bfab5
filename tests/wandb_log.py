"""Read what W&B wrote offline (`offline-run-*/run-*.wandb`) with W&B's own protobuf records.

The file is W&B's record log (a LevelDB-style log): a 7-byte header (":W&B", magic 0xBEE1, version 0), then
32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type: full / first / middle / last)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, CHUNK_HEADER, FILE_HEADER = 32 * 1024, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every `wandb_internal_pb2.Record` in one offline run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B record log"
    out, pending, pos = [], b"", FILE_HEADER
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:  # the block's tail is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(path: Path) -> list[dict]:
    """The logged rows: {key: value} with `_step` among them."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def config(path: Path) -> dict:
    """The run's config as W&B holds it (the last value of each key)."""
    out = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def metric_definitions(path: Path) -> dict[str, str]:
    """Glob or name -> the step metric it is plotted against (`define_metric`)."""
    out = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "metric":
            metric = record.metric
            out[metric.glob_name or metric.name] = metric.step_metric
    return out


def run_id(path: Path) -> str:
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.run_id
    raise AssertionError(f"{path}: no run record")
