"""Tool-calling rollouts' pure parts (llmtrain/stages/ppo/tools): the tiny template (plain chat unchanged, tool calls in
Qwen3's format), TRL's parsers on it and on Qwen3's own template, tool results as the template's tokens, the
executor's conventions and timeout, a turn's bookkeeping and the model's-own-token mask, the environment pool, and
validation."""

from __future__ import annotations

import importlib.resources
import json
import time

import pytest
import torch

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.stages.ppo.tools import tool_problems
from llmtrain.stages.ppo.tools.executor import run_tool_calls
from llmtrain.stages.ppo.tools.loading import Environments, load_environments
from llmtrain.stages.ppo.tools.multiturn import MultiTurnEngine, ToolSettings, Trajectory, from_record, laid_out, record
from llmtrain.stages.ppo.tools.parsing import parsed_turn, tool_suffix_ids, with_response_parser
from llmtrain.validation import validate
from tests.dist.workers import tools as T

# the tiny template as it was before tools (llmtrain/models/tiny_tokenizer.py): plain chat must render the same
PLAIN = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}


def call_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def parsing(tokenizer):
    return with_response_parser(tokenizer)


def test_plain_chat_renders_byte_identically(tokenizer):
    conversations = [[{"role": "user", "content": "reverse: abc\n"}],
                     [{"role": "system", "content": "s"}, {"role": "user", "content": "a\n b"},
                      {"role": "assistant", "content": "cba"}, {"role": "user", "content": ""}]]
    for messages in conversations:
        for generation in (False, True):
            ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            assert ours == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                                         chat_template=PLAIN)


@pytest.mark.parametrize("template", ["tiny", "qwen3"])
def test_a_rendered_tool_call_parses_back(tokenizer, template):
    """The assistant's turn as the template renders it -> TRL's parser (the tiny template: Qwen3's parser with its
    turn markers; Qwen3's own template: add_response_schema's) gives the call back, arguments typed."""
    from transformers import AutoTokenizer

    from tests.helpers import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    if template == "qwen3":
        tok.chat_template = (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    tok = with_response_parser(tok)
    messages = [{"role": "user", "content": "add 12 and 34"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    prompt = tok.apply_chat_template(messages[:1], tools=[T.add], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    whole = tok.apply_chat_template(messages, tools=[T.add], tokenize=True, return_dict=True)["input_ids"]
    assert whole[:len(prompt)] == prompt
    turn = parsed_turn(tok, whole[len(prompt):], prompt, [T.add])
    assert turn["tool_calls"] == [CALL]
    text = tok.decode(whole[len(prompt):])
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 34}}\n</tool_call>' in text


def test_malformed_and_plain_turns_parse_as_content(parsing):
    prompt = call_ids(parsing, "<|user|>\nq<|end|>\n<|assistant|>\n")
    assert parsed_turn(parsing, call_ids(parsing, "46<|end|>"), prompt, [T.add]) == {"role": "assistant",
                                                                                    "content": "46"}
    unclosed = parsed_turn(parsing, call_ids(parsing, '<tool_call>\n{"name": "add", "argu'), prompt, [T.add])
    assert "tool_calls" not in unclosed and unclosed["content"].startswith("<tool_call>")


def test_tool_results_are_the_templates_rendering(parsing):
    end = parsing.convert_tokens_to_ids("<|end|>")
    results = [{"role": "tool", "name": "add", "content": "46"}, {"role": "tool", "name": "add", "content": "7"}]
    expected = "\n<|user|>\n<tool_response>\n46\n</tool_response>\n<tool_response>\n7\n</tool_response><|end|>\n" \
               "<|assistant|>\n"
    assert tool_suffix_ids(parsing, results, [end, parsing.eos_token_id]) == call_ids(parsing, expected)


def test_executor_follows_trl_and_times_out():
    tools = {f.__name__: f for f in (T.add, T.divide, T.add_later, T.hang)}
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
             {"type": "function", "function": {"name": "divide", "arguments": {"a": 1, "b": 0}}},
             {"type": "function", "function": {"name": "nope", "arguments": {}}},
             {"type": "function", "function": {"name": "add_later", "arguments": {"a": 1, "b": 1}}},
             {"type": "code", "name": "x"},
             {"type": "function", "function": {"name": "hang", "arguments": {"seconds": 30}}}]
    start = time.perf_counter()
    messages, stats = run_tool_calls(calls, tools, timeout_s=0.5)
    assert time.perf_counter() - start < 5  # the hanging tool is left behind after 0.5 s
    assert [m["content"] for m in messages] == [
        "5", "{'error': 'division by zero'}", "{'error': 'Tool nope not found.'}", "2",
        "{'error': 'Unsupported tool call type: code'}",
        "{'error': \"tool 'hang' timed out after 0.5 s (ppo.tool_timeout_s)\"}"]
    assert [m["name"] for m in messages] == ["add", "divide", "nope", "add_later", "x", "hang"]
    assert (stats.calls, stats.failures, stats.timeouts) == (6, 4, 1)


def engine(tokenizer, **settings) -> MultiTurnEngine:
    from llmtrain.stages.ppo.engines import HFEngine

    return MultiTurnEngine(HFEngine(), tokenizer, [T.add], None, ToolSettings(timeout_s=5, **settings))


def stops(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id]


def test_a_turn_runs_its_call_and_masks_the_result(tokenizer):
    e = engine(tokenizer)
    t = e._start([[{"role": "user", "content": "add 12 and 34"}]], {})[0][0]
    turn = call_ids(tokenizer, '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 34}}\n</tool_call><|end|>')
    e._after_turn(t, turn, [-0.5] * len(turn), stops(tokenizer), total=200)
    suffix = call_ids(tokenizer, "\n<|user|>\n<tool_response>\n46\n</tool_response><|end|>\n<|assistant|>\n")
    assert t.completion == turn + suffix and t.own == [True] * len(turn) + [False] * len(suffix)
    assert t.logps == [-0.5] * len(turn) + [0.0] * len(suffix) and not t.done and t.iterations == 1
    assert t.messages[-1] == {"role": "tool", "name": "add", "content": "46"}
    answer = call_ids(tokenizer, "46<|end|>")
    e._after_turn(t, answer, [-0.1] * len(answer), stops(tokenizer), total=200)
    assert t.done and t.outcome == "answer" and t.ended and t.text == "46"
    assert t.prompt + t.completion == tokenizer.apply_chat_template(
        [*t.messages, {"role": "assistant", "content": "46"}], tools=[T.add], tokenize=True,
        return_dict=True)["input_ids"][:-1]  # token-exact: the template's rendering of the whole conversation


def test_a_finished_trajectory_is_saved_whole(tokenizer):
    """ppo.off_policy saves a multi-turn rollout in flight as JSON records (stage.json): laid out again, it is the same
    rollout, its tool counts and conversation included."""
    e = engine(tokenizer)
    t = e._start([[{"role": "user", "content": "add 12 and 34"}]], {})[0][0]
    turn = call_ids(tokenizer, '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 34}}\n</tool_call><|end|>')
    e._after_turn(t, turn, [-1 / 3] * len(turn), stops(tokenizer), total=200)
    answer = call_ids(tokenizer, "46<|end|>")
    e._after_turn(t, answer, [-0.1] * len(answer), stops(tokenizer), total=200)
    back = from_record(json.loads(json.dumps(record(t))))
    assert (back.messages, back.stats, back.outcome, back.text, back.iterations) == \
        (t.messages, t.stats, t.outcome, t.text, t.iterations) and back.stats.calls == 1
    before, after = laid_out([t], 0, "cpu", None), laid_out([back], 0, "cpu", None)
    for name in ("sequences", "attention_mask", "action_mask", "ended", "engine_logps"):
        assert torch.equal(getattr(before, name), getattr(after, name)), name


@pytest.mark.parametrize("case", ["never_closed", "iterations", "result_overlong"])
def test_counted_ends(tokenizer, case):
    e = engine(tokenizer, max_iterations=0 if case == "iterations" else None)
    t = e._start([[{"role": "user", "content": "q"}]], {})[0][0]
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    turn = call_ids(tokenizer, text[:30] if case == "never_closed" else text + "<|end|>")  # cut at the budget
    e._after_turn(t, turn, [0.0] * len(turn), stops(tokenizer), total=len(turn) + 10)
    outcome = {"never_closed": "truncated"}.get(case, case)
    assert t.done and t.outcome == outcome and t.completion == turn and all(t.own)
    assert t.ended == (case != "never_closed")
    assert t.malformed == (case == "never_closed")  # an unclosed call is content, counted


def test_layout_masks_only_the_models_tokens():
    a = Trajectory([], [5, 6, 7], [], completion=[10, 11, 20, 21, 22, 12], own=[1, 1, 0, 0, 0, 1],
                   logps=[-1.0, -2.0, 0.0, 0.0, 0.0, -3.0], ended=True, text="x")
    b = Trajectory([], [8], [], completion=[13], own=[1], logps=[-4.0], ended=False, text="y")
    rollout = laid_out([a, b], pad_token_id=0, device="cpu", group=None)
    assert rollout.sequences.tolist() == [[5, 6, 7, 10, 11, 20, 21, 22, 12], [0, 0, 8, 13, 0, 0, 0, 0, 0]]
    assert rollout.attention_mask.tolist() == [[1] * 9, [0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert rollout.action_mask.tolist() == [[True, True, False, False, False, True], [True] + [False] * 5]
    assert rollout.engine_logps.tolist() == [[-1.0, -2.0, 0.0, 0.0, 0.0, -3.0], [-4.0] + [0.0] * 5]
    assert rollout.ended.tolist() == [True, False] and rollout.texts == ["x", "y"]
    from llmtrain.losses.advantages import token_rewards
    from llmtrain.stages.ppo.packed import NO_STATE, action_rows

    rewards = token_rewards(torch.zeros(2, 6), torch.tensor([1.0, 2.0]), rollout.action_mask, 0.0)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 1.0], [2.0, 0, 0, 0, 0, 0]]  # the score on the last own token
    rows = action_rows(rollout.sequences, rollout.attention_mask, 6, "sdpa_packable")
    # packed: the state before each column is its predecessor in the row (tool columns included), none past the end
    assert rows.states.tolist() == [[2, 3, 4, 5, 6, 7, NO_STATE], [9, NO_STATE, NO_STATE, NO_STATE, NO_STATE,
                                                                   NO_STATE, NO_STATE]]


def test_environments_are_pooled_reset_and_scored(tokenizer):
    from llmtrain.stages.ppo.rewards import call_reward_function

    environments = load_environments("tests.dist.workers.tools:Counter")
    built = T.Counter.built
    first = environments.draw([None, None])
    assert T.Counter.built == built + 1  # the probe is pooled: one more for the second rollout
    assert environments.draw([None, None]) == first and T.Counter.built == built + 1  # reused, not rebuilt
    e = MultiTurnEngine(engine(tokenizer).inner, tokenizer, [T.add], environments, ToolSettings())
    trajectories, instances = e._start([[{"role": "user", "content": "count"}]] * 2, {"target": [3, 4]})
    assert trajectories[0].messages[-1]["content"] == "count (target 3)"  # reset's text joins the last user turn
    assert [f.__name__ for f in trajectories[0].tools] == ["add", "increment"]
    assert '"name": "increment"' in tokenizer.decode(trajectories[0].prompt)
    instances[0].increment(3)
    reward = environments.reward_functions()[0]
    assert reward.name == "Counter"
    scores = call_reward_function(reward.function, ["p"] * 2, ["r"] * 2, {"environments": instances})
    assert scores == [1.0, 0.0]


def test_a_dict_of_environments_routes_rows_by_column():
    environments = load_environments({"count": "tests.dist.workers.tools:Counter"})
    assert environments.names_of({"environment": ["count"]}, 1) == ["count"]
    with pytest.raises(ConfigError, match="not among ppo.environment"):
        environments.names_of({"environment": ["chess"]}, 1)
    with pytest.raises(ConfigError, match="'environment' column"):
        environments.names_of({}, 1)
    assert isinstance(environments, Environments)


BASE = ["recipe=grpo_tiny", "model.name_or_path=x", "ppo.rollout.max_new_tokens=8"]


@pytest.mark.parametrize("overrides, message", [
    (["ppo.environment=no_such_module_xyz:Env"], "ppo.environment='no_such_module_xyz:Env': cannot import"),
    (["ppo.environment={chess: no_such_module_xyz:Env}"], "ppo.environment.chess="),
    (["ppo.tools=[tests.dist.workers.tools:undocumented]"], "ppo.tools: tool 'undocumented' cannot be described"),
    (["ppo.tools=[tests.dist.workers.tools]"], "must be module:attribute"),
    (["ppo.tools=[tests.dist.workers.tools:add]", "ppo.tool_timeout_s=0"], "ppo.tool_timeout_s=0"),
    (["ppo.tools=[tests.dist.workers.tools:add]", "ppo.max_tokens_per_turn=9"], "ppo.max_tokens_per_turn=9"),
])
def test_validation_names_the_field(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(compose_config([*BASE, *overrides]), world_size=1)
    assert message in str(error.value)


def test_gae_is_refused_and_get_reward_is_a_reward_source():
    cfg = compose_config(["recipe=ppo_tiny", "model.name_or_path=x", "ppo.tools=[tests.dist.workers.tools:add]"])
    assert any("ppo.advantage=gae" in p for p in tool_problems(cfg.ppo))
    cfg = compose_config([*BASE, "ppo.reward.function=null", "ppo.environment=tests.dist.workers.tools:Counter"])
    validate(cfg, world_size=1)  # the environment's get_reward scores: no other source needed
