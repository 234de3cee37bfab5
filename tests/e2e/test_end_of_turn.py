"""End of turn as one notion: SFT on chat `messages` teaches replies to end at the template's end-of-turn token
(`<|end|>`, not the tokenizer's eos `</s>`); GRPO from that export stops there, masks through it and counts it in
`eos_rate`, and the run log names the stop tokens. Before, rollouts stopped only at eos and ran to max_new_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, assert_ok, read_metrics, run_cli

pytestmark = pytest.mark.e2e

DATA = REPO / "llmtrain" / "assets" / "data"


def as_messages(source: Path, target: Path, limit: int | None = None) -> Path:
    rows = [json.loads(line) for line in source.read_text().splitlines()][:limit]
    target.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"].strip()},
                                                       {"role": "assistant", "content": r["response"]}]}) + "\n"
                              for r in rows))
    return target


@pytest.fixture(scope="module")
def chat_sft(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat_sft")
    train, held_out = as_messages(DATA / "reverse_train.jsonl", root / "train.jsonl"), \
        as_messages(DATA / "reverse_eval.jsonl", root / "eval.jsonl", 64)
    out = root / "run"
    assert_ok(run_cli(["recipe=sft_tiny", "data.format=messages", f"data.train_files=[{train}]",
                       f"data.eval_files=[{held_out}]", "trainer.max_steps=150", "trainer.eval_every_n_steps=0",
                       "trainer.save_every_n_steps=0", f"output_dir={out}"], timeout=900))
    return out


def test_grpo_after_chat_sft_stops_at_the_end_of_turn(chat_sft, tmp_path):
    prompts = as_messages(DATA / "reverse_eval.jsonl", tmp_path / "prompts.jsonl", 64)
    out = tmp_path / "grpo"
    result = run_cli(["recipe=grpo_tiny", f"model.name_or_path={chat_sft / 'hf'}", "data.format=messages",
                      f"data.train_files=[{prompts}]", "data.eval_files=[]", "data.eval_fraction=0",
                      "trainer.max_steps=1", "trainer.eval_every_n_steps=0", "ppo.rollout.prompts_per_step=16",
                      "ppo.mini_batch_size=64", "ppo.epochs=1", f"output_dir={out}"], timeout=900)
    assert_ok(result)
    assert "stop tokens: </s> (257, eos), <|end|> (262, end of turn)" in result.stderr, result.stderr[-3000:]
    first = read_metrics(out)[0][0]
    assert first["eos_rate"] > 0.9, first
    assert first["response_len"] < 16, first  # stopped, not cut at max_new_tokens
