"""GRPO with a calculator tool (ppo.tools) on 2 ranks, from a tiny model trained in the fixture to call `add` and answer
with its result, sampled by the hf engine (the worker tests/dist/workers/tool_rollout.py) and through the session's
vLLM server (tests/dist/workers/vllm_tool_rollout.py): trajectories are token-exact (the whole conversation as the chat
template renders it), tool-result tokens are exactly the template's rendering of the result and carry no loss
weight, the first ratio of every iteration is exactly 1 over a mask with holes, and the tool counts are logged as TRL
logs them. Through vLLM: the engine's log-probs on the model's tokens equal the trainer's, and with
ppo.off_policy.max_staleness=1 the whole multi-turn loop runs ahead, its rollout in flight saved and restored whole."""

from __future__ import annotations

import json
import subprocess

import pytest
from transformers import AutoTokenizer

from tests.dist.workers.tools import add, conversations, save_memorized_model
from tests.helpers import PYTHON, REPO, assert_ok, cli_env

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tool_model")
    assert save_memorized_model(directory) < 0.05  # the conversations are learnt (mean loss per completion token)
    return directory


def launch(worker: str, out, *args: str) -> list[dict]:
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m", worker, *args,
           str(out)]
    assert_ok(subprocess.run(cmd, env=cli_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=400,
                             cwd=REPO))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory):
    return model_dir, launch("tests.dist.workers.tool_rollout", tmp_path_factory.mktemp("tool_rollout"),
                             str(model_dir))


@pytest.fixture(scope="module")
def vllm_ranks(model_dir, vllm_server, tmp_path_factory):
    return model_dir, launch("tests.dist.workers.vllm_tool_rollout", tmp_path_factory.mktemp("vllm_tool_rollout"),
                             str(model_dir), vllm_server.url)


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


def token_exact_tool_calls(record: dict, rank: int, tokenizer) -> tuple[int, int, list[list[bool]]]:
    """Checks rank `rank`'s rollout `record` against the template's rendering of its conversation: (tool results
    seen, rows that are the whole conversation token for token, each row's tool-token flags)."""
    conversation = conversations()[rank]
    result = conversation[2]["content"]
    # Qwen3's tool-response block in the tiny template's turn markers, written out by hand
    rendering = tokenizer(f"\n<|user|>\n<tool_response>\n{result}\n</tool_response><|end|>\n<|assistant|>\n",
                          add_special_tokens=False)["input_ids"]
    whole = tokenizer.apply_chat_template(conversation, tools=[add], tokenize=True, return_dict=True)["input_ids"]
    width, calls, exact, tool_flags = len(record["action_mask"][0]), 0, 0, []
    for i, (tokens, attention, own) in enumerate(zip(record["sequences"], record["attention_mask"],
                                                     record["action_mask"])):
        completion = tokens[-width:]
        tool = [bool(a) and not o for a, o in zip(attention[-width:], own)]
        tool_flags.append(tool)
        for start, end in spans(tool):
            calls += 1
            assert completion[start:end] == rendering
        if record["texts"][i] == result:  # the conversation as trained: the template's rendering, token for token
            exact += 1
            real = [t for t, a in zip(tokens, attention) if a]
            assert real == whole[:-1]  # the template's "\n" after the last end of turn is not generated
    return calls, exact, tool_flags


def test_trajectories_are_token_exact_and_tool_tokens_carry_no_loss(ranks):
    model_dir, records = ranks
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calls = exact = 0
    for rank, record in enumerate(records):
        rank_calls, rank_exact, _ = token_exact_tool_calls(record, rank, tokenizer)
        calls, exact = calls + rank_calls, exact + rank_exact
        for i, own in enumerate(record["action_mask"]):
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


def test_vllm_multi_turn_rollouts_are_token_exact_with_the_engines_log_probs(vllm_ranks):
    model_dir, records = vllm_ranks
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calls = exact = 0
    for rank, record in enumerate(r["on_policy"] for r in records):
        assert record["sync_max_abs"] <= 1e-3 and record["engine_version"] == "policy-0"
        rank_calls, rank_exact, tool_flags = token_exact_tool_calls(record, rank, tokenizer)
        calls, exact = calls + rank_calls, exact + rank_exact
        for i, (own, engine, tool) in enumerate(zip(record["action_mask"], record["engine_logps"], tool_flags)):
            row = rank * 4 + i  # the global experience's row
            assert records[0]["on_policy"]["exp_action_mask"][row] == own
            trainer = records[0]["on_policy"]["old_logps"][row]
            # the engine's log-prob of each of the model's tokens is the trainer's; 0 on the tool's tokens
            assert all(abs(e - t) < 1e-3 for e, t, o in zip(engine, trainer, own) if o), (engine, trainer)
            assert all(e == 0.0 for e, t in zip(engine, tool) if t)
        assert any(sum(e for e, o in zip(engine, own) if o) < -1e-3
                   for engine, own in zip(record["engine_logps"], record["action_mask"]))  # sampled, not greedy
    assert calls >= 2 and exact >= 2  # each rank's memorised call happened, through the server
    metrics = records[0]["on_policy"]["metrics"]
    assert metrics == records[1]["on_policy"]["metrics"]  # counted over both ranks
    assert metrics["tools_call_frequency"] == calls / 8 and metrics["tools_failure_frequency"] == 0.0


def test_vllm_multi_turn_rollouts_run_ahead_and_resume_whole(vllm_ranks):
    model_dir, records = vllm_ranks
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calls = 0
    for rank, record in enumerate(r["off_policy"] for r in records):
        assert record["saved_iterations"] == [2]  # iteration 2's rollout was in flight at the save
        steps = record["steps"]
        assert [s["staleness_max"] for s in steps] == [0.0, 1.0] and [s["rollout_version"] for s in steps] == [0, 0]
        assert all(s["first_ratio_dev"] == 0.0 and s["loss"] == s["loss"] and "tools_call_frequency" in s
                   for s in steps), steps
        calls += token_exact_tool_calls(record["straight"], rank, tokenizer)[0]
        # the rollout restored from the saved state is the one the uninterrupted stage trained on, bit for bit
        assert record["resumed"] == record["straight"]
    assert calls >= 2
    for a, b in zip(records[0]["off_policy"]["steps"], records[1]["off_policy"]["steps"]):  # the counts are global
        assert {k: v for k, v in a.items() if k.startswith("tools_")} == \
            {k: v for k, v in b.items() if k.startswith("tools_")}
