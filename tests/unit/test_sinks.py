"""The console sink: metrics lines always, a live progress display only on a terminal."""

import threading

from llmtrain.metrics.sinks import ConsoleSink


def test_console_off_a_terminal_prints_lines_and_runs_no_live_display(capsys):
    threads_before = threading.active_count()
    sink = ConsoleSink(max_steps=4, start_step=0, every=2)  # pytest captures stderr: not a terminal
    assert sink.progress is None and threading.active_count() == threads_before  # no refresh thread
    for step in (1, 2, 3):
        sink.log({"step": step, "loss": 1.0 / step, "lr": 1e-3})
    sink.log({"step": 3, "eval_loss": 0.25})
    sink.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[:2] for line in lines] == [["train", "step=1"], ["train", "step=2"], ["eval", "step=3"]]


def test_jsonl_on_resume_drops_replayed_rows_and_a_torn_last_line(tmp_path, caplog):
    """A restart from step 5 after rank 0 wrote steps up to 7, the last one cut short: steps 6-7 go (the restart
    replays them), the torn line goes with a warning, and the file stays one record per step."""
    import json

    from llmtrain.metrics.sinks import JsonlSink

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 8)] + [json.dumps({"step": 5, "eval_loss": 2.0})]
    path.write_text("\n".join(rows) + "\n" + '{"step": 8, "lo')
    sink = JsonlSink(path, resume_step=5)
    for step in (6, 7):
        sink.log({"step": step, "loss": 0.5})
    sink.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6, 7]
    assert [r for r in records if "eval_loss" in r] == [{"step": 5, "eval_loss": 2.0}]
    assert "is not a whole JSON record" in caplog.text
