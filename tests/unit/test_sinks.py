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
