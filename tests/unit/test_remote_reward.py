"""A reward server (`ppo.reward.url`) against a real HTTP server on 127.0.0.1: batches, OpenRLHF's fields, retries on
5xx, and a clear error naming the URL for a 4xx, a wrong length, a non-number, a timeout or a refused connection;
its scores summed with a reward function's at their weights; bad settings refused before anything loads."""

from __future__ import annotations

import time

import pytest

from llmtrain.config import ConfigError
from llmtrain.stages.ppo.remote_reward import RemoteReward, RewardServerError
from llmtrain.stages.ppo.rewards import Completions, RewardFunction, combined_scores, score_metrics
from llmtrain.validation import validate
from tests.helpers import JsonServer


def length_server(script: list | None = None) -> JsonServer:
    """Scores each response by its length; `script` answers the first requests otherwise ((status, body), or a sleep
    in seconds before scoring)."""
    script = list(script or [])

    def answer(body: dict) -> tuple[int, dict]:
        step = script.pop(0) if script else None
        if isinstance(step, tuple):
            return step
        if step is not None:
            time.sleep(step)
        return 200, {"rewards": [float(len(r)) for r in body["responses"]]}

    return JsonServer(answer)


@pytest.fixture
def server_factory():
    started = []

    def start(script=None) -> JsonServer:
        started.append(length_server(script))
        return started[-1]

    yield start
    for server in started:
        server.close()


def completions(texts: list[str], **columns) -> Completions:
    prompts = [f"p{i}" for i in range(len(texts))]
    return Completions(prompts=prompts, texts=texts, ids=[[1]] * len(texts), columns=columns,
                       queries=[f"<s>{p} {t}</s>" for p, t in zip(prompts, texts)])


def test_scores_come_back_in_batches_with_openrlhfs_fields(server_factory):
    server = server_factory()
    texts = ["a", "bb", "ccc", "dddd", "eeeee"]
    scores = RemoteReward(server.url, batch_size=2).score_completions(completions(texts, response=list("vwxyz")))
    assert scores == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [len(r["responses"]) for r in server.requests] == [2, 2, 1]
    first = server.requests[0]
    assert first["query"] == ["<s>p0 a</s>", "<s>p1 bb</s>"] and first["prompts"] == ["p0", "p1"]
    assert first["labels"] == ["v", "w"] and first["columns"] == {"response": ["v", "w"]}


def test_a_5xx_is_retried_and_a_4xx_is_not(server_factory):
    flaky = server_factory([(503, {"error": "warming up"})])
    assert RemoteReward(flaky.url, retries=1).score_completions(completions(["ab"])) == [2.0]
    assert len(flaky.requests) == 2
    refusing = server_factory([(400, {"error": "bad field"})] * 3)
    with pytest.raises(RewardServerError, match=rf"{refusing.url}.*HTTP 400.*bad field"):
        RemoteReward(refusing.url, retries=2).score_completions(completions(["ab"]))
    assert len(refusing.requests) == 1


@pytest.mark.parametrize("answer,needle", [
    ({"rewards": [1.0]}, "answered 1 rewards for 2 responses"),
    ({"rewards": [1.0, None]}, "not a finite number: None"),
    ({"rewards": [1.0, "high"]}, "not a finite number: 'high'"),
    ({"score": 1.0}, 'without a "rewards" list'),
])
def test_a_wrong_answer_names_the_url(server_factory, answer, needle):
    server = server_factory([(200, answer)])
    with pytest.raises(RewardServerError, match=server.url):
        try:
            RemoteReward(server.url).score_completions(completions(["a", "b"]))
        except RewardServerError as error:
            assert needle in str(error)
            raise


def test_a_server_that_hangs_or_is_gone_fails_within_the_bound(server_factory):
    slow = server_factory([5.0, 5.0])
    start = time.perf_counter()
    with pytest.raises(RewardServerError, match=rf"{slow.url}.*failed 2 times.*url_timeout_s=0.2"):
        RemoteReward(slow.url, timeout_s=0.2, retries=1).score_completions(completions(["a"]))
    assert time.perf_counter() - start < 2.0  # two tries of 0.2 s and one 0.5 s back-off
    gone = server_factory()
    gone.close()
    with pytest.raises(RewardServerError, match=gone.url):
        RemoteReward(gone.url, retries=0).score_completions(completions(["a"]))


def test_server_scores_sum_with_functions_at_their_weights(server_factory):
    server = server_factory()
    def first_letter_is_a(prompts, responses):
        return [float(r[0] == "a") for r in responses]

    sources = [RewardFunction("m:first_letter_is_a", first_letter_is_a),
               RewardFunction(server.url, RemoteReward(server.url), 0.5, metric="score_remote")]
    totals, means = combined_scores(sources, completions(["abc", "bb"]))
    assert totals == [1.0 + 0.5 * 3, 0.0 + 0.5 * 2]
    assert score_metrics(sources, means) == {"score_fn_first_letter_is_a": 0.5, "score_remote": 2.5}


def test_a_failing_source_stops_the_step_with_its_own_error(server_factory):
    server = server_factory([(404, {"detail": "Not Found"})])
    sources = [RewardFunction(server.url, RemoteReward(server.url))]
    with pytest.raises(RewardServerError, match="HTTP 404"):
        combined_scores(sources, completions(["a"]))


GRPO = ["recipe=pretrain_tiny", "stage=grpo", "data=reverse", "data.packing=false",
        "ppo.reward.function=llmtrain.rewards.reversal:score"]  # no base model to build


@pytest.mark.parametrize("override,needle", [
    ("ppo.reward.url=localhost:5000", "ppo.reward.url='localhost:5000' must be an http"),
    ("ppo.reward.url_timeout_s=0", "ppo.reward.url_timeout_s=0.0 must be > 0"),
    ("ppo.reward.url_batch_size=0", "ppo.reward.url_batch_size=0 must be >= 1"),
])
def test_bad_server_settings_are_refused(override, needle):
    from llmtrain.compose import compose_config

    cfg = compose_config([*GRPO, "ppo.reward.url=http://127.0.0.1:5000/get_reward", override])
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate(cfg, world_size=1)


def test_a_server_alone_is_a_reward_source():
    from llmtrain.compose import compose_config

    cfg = compose_config([*GRPO, "ppo.reward.function=null", "ppo.reward.url=http://127.0.0.1:1/r"])
    validate(cfg, world_size=1)
