"""GRPO with a calculator tool (ppo.tools) on 2 ranks (the worker tests/dist/workers/tool_rollout.py), from a tiny
model trained in the fixture to call `add` and answer with its result: trajectories are token-exact (the whole
conversation as the chat template renders it), tool-result tokens are exactly the template's rendering of the
result and carry no loss weight, the first ratio of every iteration is exactly 1 over a mask with holes, and the
tool counts are logged as TRL logs them."""

from __future__ import annotations

import json
import subprocess

import pytest
from transformers import AutoTokenizer

from tests.dist.workers.tools import add, conversations, save_memorized_model
from tests.helpers import PYTHON, REPO, assert_ok, cli_env

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tool_model")
    assert save_memorized_model(model_dir) < 0.05  # the conversations are learnt (mean loss per completion token)
    out = tmp_path_factory.mktemp("tool_rollout")
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "-m", "tests.dist.workers.tool_rollout", str(model_dir), str(out)]
    assert_ok(subprocess.run(cmd, env=cli_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=400,
                             cwd=REPO))
    return model_dir, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def spans(flags: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of True as (start, end)."""
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_trajectories_are_token_exact_and_tool_tokens_carry_no_loss(ranks):
    model_dir, records = ranks
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calls = exact = 0
    for rank, record in enumerate(records):
        conversation = conversations()[rank]
        result = conversation[2]["content"]
        # Qwen3's tool-response block in the tiny template's turn markers, written out by hand
        rendering = tokenizer(f"\n<|user|>\n<tool_response>\n{result}\n</tool_response><|end|>\n<|assistant|>\n",
                              add_special_tokens=False)["input_ids"]
        whole = tokenizer.apply_chat_template(conversation, tools=[add], tokenize=True, return_dict=True)["input_ids"]
        width = len(record["action_mask"][0])
        for i, (tokens, attention, own) in enumerate(zip(record["sequences"], record["attention_mask"],
                                                         record["action_mask"])):
            completion = tokens[-width:]
            tool = [bool(a) and not o for a, o in zip(attention[-width:], own)]
            for start, end in spans(tool):
                calls += 1
                assert completion[start:end] == rendering
            if record["texts"][i] == result:  # the conversation as trained: the template's rendering, token for token
                exact += 1
                real = [t for t, a in zip(tokens, attention) if a]
                assert real == whole[:-1]  # the template's "\n" after the last end of turn is not generated
            # global rows of this rank: rank·4 ..; the loss's gradient lies on the model's own tokens only
            row = rank * 4 + i
            assert records[0]["exp_action_mask"][row] == own
            grad = records[0]["grad"][row]
            assert all(g == 0.0 for g, o in zip(grad, own) if not o)
            assert all(a == 0.0 for a, o in zip(records[0]["advantages"][row], own) if not o)
            assert all(k == 0.0 for k, o in zip(records[0]["kl"][row], own) if not o)
            if records[0]["advantages"][row][0] != 0.0:
                assert all(g != 0.0 for g, o in zip(grad, own) if o)
    assert calls >= 2 and exact >= 2  # each rank's memorised call happened (the test checks something)
    metrics = records[0]["metrics"]
    assert metrics == records[1]["metrics"]  # counted over both ranks
    assert metrics["tools_call_frequency"] == calls / 8 and metrics["tools_share"] == calls / 8
    assert metrics["tools_failure_frequency"] == 0.0 and metrics["tools_result_tokens"] > 0


def test_grpo_iterations_with_tools(ranks):
    _, records = ranks
    for record in records:
        for step in record["steps"]:
            assert step["first_ratio_dev"] == 0.0  # the update's first forward scores the rollout's own tokens
            assert "tools_call_frequency" in step and "tools_malformed" in step
            assert step["loss"] == step["loss"]  # finite
        assert record["eval"]["eval_exact_match"] == 1.0  # greedy: call, read the result, answer
    for a, b in zip(records[0]["steps"], records[1]["steps"]):  # the counts are global
        assert {k: v for k, v in a.items() if k.startswith("tools_")} == \
            {k: v for k, v in b.items() if k.startswith("tools_")}
