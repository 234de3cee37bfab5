"""Sources: local files, save_to_disk directories, the seeded eval split, main_process_first."""

import json
import time

import datasets
import pytest

from llmtrain.data.errors import DataConfigError
from llmtrain.data.sources import load_rows, split_eval
from tests.helpers import spawn_ranks

RECORDS = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(5)]


def test_loads_jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    assert load_rows([str(path)], None).to_list() == RECORDS


def test_loads_parquet(tmp_path):
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(RECORDS).to_parquet(str(path))
    assert load_rows([str(path)], None).to_list() == RECORDS


def test_loads_a_save_to_disk_directory_and_its_split(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(tmp_path / "d"))
    assert load_rows(None, str(tmp_path / "d"), split="train").to_list() == RECORDS
    with pytest.raises(DataConfigError, match="data.dataset"):
        load_rows(None, str(tmp_path / "d"), split="test")


def test_missing_file_names_the_field_and_the_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataConfigError) as error:
        load_rows([missing], None)
    assert "data.train_files" in str(error.value) and missing in str(error.value)


def test_unsupported_suffix_and_both_sources_are_config_errors(tmp_path):
    with pytest.raises(DataConfigError, match="data.train_files"):
        load_rows([str(tmp_path / "rows.csv")], None)
    with pytest.raises(DataConfigError, match="exactly one"):
        load_rows(["a.jsonl"], "some/dataset")


def test_split_eval_is_deterministic_disjoint_and_complete():
    rows = datasets.Dataset.from_dict({"i": list(range(100))})
    train, held_out = split_eval(rows, 0.2, seed=7)
    train_again, held_out_again = split_eval(rows, 0.2, seed=7)
    assert train["i"][:] == train_again["i"][:] and held_out["i"][:] == held_out_again["i"][:]
    assert len(held_out) == 20
    assert set(train["i"]).isdisjoint(held_out["i"])
    assert sorted(list(train["i"]) + list(held_out["i"])) == list(range(100))
    assert list(split_eval(rows, 0.2, seed=8)[1]["i"]) != list(held_out["i"])


def _record_order(rank: int, port: int, events) -> None:
    import torch.distributed as dist

    from llmtrain.data.dataset import main_process_first

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    with main_process_first():
        events.put((rank, "enter", time.monotonic()))
        time.sleep(0.5 if rank == 0 else 0.0)
        events.put((rank, "exit", time.monotonic()))
    dist.destroy_process_group()


def test_main_process_first_runs_rank_zero_before_the_others():
    events, exit_codes = spawn_ranks(_record_order, messages=4)
    assert exit_codes == [0, 0]
    times = {(rank, kind): t for rank, kind, t in events}
    assert times[(1, "enter")] >= times[(0, "exit")]


def test_main_process_first_is_a_no_op_without_a_process_group():
    from llmtrain.data.dataset import main_process_first

    ran = []
    with main_process_first():
        ran.append(True)
    assert ran == [True]
