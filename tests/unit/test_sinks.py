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


def test_wandb_names_group_flat_keys_by_one_table():
    from llmtrain.metrics.sinks import wandb_key
    from llmtrain.stages.registry import stage_spec

    expected = {("loss", "sft"): "train/loss", ("eval_accuracy", "sft"): "eval/accuracy",
                ("tokens_per_s", "sft"): "perf/tokens_per_s", ("mfu", "sft"): "perf/mfu",
                ("memory_r1_params", "sft"): "memory/r1_params",
                ("plan_memory_activations", "sft"): "memory/plan_activations",
                ("comm_r0_wire_bytes", "sft"): "comm/r0_wire_bytes", ("kl_coef", "ppo"): "ppo/kl_coef",
                ("time_rollout", "grpo"): "ppo/time_rollout", ("eval_score", "ppo"): "eval/score",
                ("accuracy", "reward"): "reward/accuracy", ("chosen_reward", "dpo"): "dpo/chosen_reward",
                ("loss", "dpo"): "train/loss", ("critic_memory_r0_grads", "ppo"): "memory/critic_r0_grads",
                ("samples_per_s", "ppo"): "perf/samples_per_s", ("time_rollout_s", "ppo"): "ppo/time_rollout_s"}
    assert {(key, stage): wandb_key(key, stage_spec(stage).metric_group) for key, stage in expected} == expected


def test_redact_hides_credential_keys_and_token_shaped_values_only():
    from llmtrain.metrics.sinks import REDACTED, redact

    config = {"hub_token": "abc", "hf": {"API_KEY": 7, "password": "pw"}, "note": "use hf_abcdefghijk0",
              "url": "https://me:pw@host/data", "pad_token": "<pad>", "max_new_tokens": 8, "tokenizer": "/tok",
              "run_metadata": {"git_sha": "a" * 40}, "tags": ["x", "sk-abcdefgh12345"]}
    assert redact(config) == {**config, "hub_token": REDACTED, "hf": {"API_KEY": REDACTED, "password": REDACTED},
                              "note": REDACTED, "url": REDACTED, "tags": ["x", REDACTED]}


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
