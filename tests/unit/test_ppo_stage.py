"""PPO's host-side pieces in one process: action masks, left padding, prompt data, reward functions and shaping,
the update layout, trimming, the config's rules and the reversal reward."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch
from transformers import AutoTokenizer

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.data.prompts import build_prompts, collate_prompts, split_row
from llmtrain.rewards.reversal import score as reversal_score
from llmtrain.stages.ppo.experience import Experience, update_layout
from llmtrain.stages.ppo.rewards import ScoreShaping, call_reward_function, last_action_positions, load_reward_function
from llmtrain.stages.ppo.rollout import Rollout, model_inputs, up_to_first_eos
from llmtrain.validation import validate
from tests.helpers import TOKENIZER_DIR

EOS = 2


def test_action_mask_keeps_the_first_eos_even_when_pad_is_eos():
    generated = torch.tensor([[5, 6, EOS, EOS, EOS],  # pad == eos after the real EOS
                              [5, EOS, 7, 8, EOS],  # tokens after the first EOS are not actions
                              [5, 6, 7, 8, 9]])  # cut at max_new_tokens: every token is an action
    mask = up_to_first_eos(generated, torch.tensor([EOS]))
    assert mask.tolist() == [[True, True, True, False, False], [True, True, False, False, False], [True] * 5]
    assert (generated != EOS).tolist()[0] != mask.tolist()[0]  # what `seq != pad` would have dropped: the EOS


def test_left_padded_forward_equals_the_unpadded_one(tiny_llama):
    model = tiny_llama(attn_implementation="sdpa", vocab_size=64, hidden_size=32, intermediate_size=64).eval()
    short, long = torch.randint(3, 64, (1, 4)), torch.randint(3, 64, (1, 7))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        padded = model(**model_inputs(batch, mask)).logits
        alone = model(short).logits
    assert torch.allclose(padded[0, 3:], alone[0], atol=1e-5)
    assert not padded.isnan().any()


def test_last_action_positions_point_at_each_rows_eos():
    actions = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    sequences = torch.zeros(3, 5, dtype=torch.long)
    rollout = Rollout(sequences, torch.ones(3, 5, dtype=torch.long), actions, torch.ones(3, dtype=torch.bool), [], {},
                      torch.ones(3, dtype=torch.bool))
    assert last_action_positions(rollout).tolist() == [0 * 5 + 2 + 1, 1 * 5 + 2 + 2, 2 * 5 + 2 + 0]


def test_prompt_data_keeps_the_raw_prompt_and_the_other_columns(tmp_path):
    import datasets

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.pad_token = tokenizer.eos_token
    rows = datasets.Dataset.from_list([{"prompt": "reverse: ab\n", "response": "ba", "level": 1},
                                       {"prompt": "reverse: " + "x" * 80 + "\n", "response": "x", "level": 2}])
    examples, stats = build_prompts(rows, tokenizer, "prompt_response", max_prompt_len=32)
    assert (stats.samples_in, stats.samples_out, stats.dropped_overlong) == (2, 1, 1)
    item = examples[0]
    assert item["prompt"] == "reverse: ab\n" and item["columns"] == {"response": "ba", "level": 1}
    assert item["prompt_ids"][0] == tokenizer.bos_token_id  # encoded as the SFT stage encodes a prompt
    batch = collate_prompts([item, {**item, "prompt_ids": item["prompt_ids"][:3]}], tokenizer.pad_token_id)
    assert batch.attention_mask[1].tolist()[-3:] == [1, 1, 1] and batch.attention_mask[1, 0] == 0  # left padding
    assert batch.columns == {"level": [1, 1], "response": ["ba", "ba"]}


def test_messages_rows_give_the_turns_before_the_last_answer_as_the_prompt():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    prompt, columns = split_row({"messages": messages, "id": 3}, "messages")
    assert prompt == messages[:1] and columns == {"id": 3, "response": "hello"}


def test_reward_function_gets_named_columns_or_all_of_them():
    def named(prompts, responses, answer):
        return [float(r == a) for r, a in zip(responses, answer)]

    def everything(prompts, responses, **columns):
        return [float(len(columns))] * len(responses)

    columns = {"answer": ["a", "b"], "other": [1, 2]}
    assert call_reward_function(named, ["p", "q"], ["a", "x"], columns) == [1.0, 0.0]
    assert call_reward_function(everything, ["p", "q"], ["a", "x"], columns) == [2.0, 2.0]
    with pytest.raises(ValueError, match="returned 1 scores for 2"):
        call_reward_function(lambda p, r: [0.0], ["p", "q"], ["a", "x"], {})
    # None or NaN: the function does not score that response (TRL's rule); an infinity is an error
    assert call_reward_function(lambda p, r: [0.0, math.nan], ["p", "q"], ["a", "x"], {}) == [0.0, None]
    with pytest.raises(ValueError, match="infinite"):
        call_reward_function(lambda p, r: [0.0, math.inf], ["p", "q"], ["a", "x"], {})


def test_reward_function_is_imported_by_module_and_attribute(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def score(prompts, responses, **columns):
            return [1.0 for _ in responses]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_function("my_rewards:score")(["p"], ["r"]) == [1.0]
    for spec, message in [("my_rewards", "module:attribute"), ("no_such_module_xyz:score", "cannot import"),
                          ("my_rewards:missing", "no callable")]:
        with pytest.raises(ConfigError, match=message):
            load_reward_function(spec)
    sys.modules.pop("my_rewards", None)


def test_score_shaping_normalises_clips_and_penalises_a_missing_eos():
    shaping = ScoreShaping(clip=1.0, statistics=(2.0, 0.5), missing_eos_penalty=-0.25)
    scores = shaping.apply(torch.tensor([2.5, 0.0, 2.0]), ended=torch.tensor([True, True, False]))
    assert scores.tolist() == [1.0, -1.0, -0.25]  # (2.5-2)/0.5 = 1; (0-2)/0.5 = -4 -> -1; 0 - 0.25


def test_update_layout_covers_each_mini_batch_once_across_ranks():
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    per_rank = [update_layout(order, mini_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    for k in range(2):
        rows = torch.cat([torch.cat(per_rank[r][k]) for r in range(2)])
        assert sorted(rows.tolist()) == sorted(order[8 * k:8 * (k + 1)].tolist())
        assert all(len(micro) == 2 for r in range(2) for micro in per_rank[r][k])


def test_trimming_keeps_actions_aligned_with_the_positions_that_predict_them():
    sequences = torch.arange(2 * 9).view(2, 9)
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0, 0]])
    actions = torch.tensor([[True, True, True, False, False], [True, True, False, False, False]])
    zeros = torch.zeros(2, 5)
    exp = Experience(sequences, attention, actions, zeros, zeros, zeros, zeros, zeros, zeros, torch.zeros(2), zeros,
                     torch.ones(2, dtype=torch.bool))
    trimmed = exp.trimmed()
    assert trimmed.num_actions == 3 and trimmed.sequences.shape == (2, 6)  # 1 left column, 2 right columns cut
    assert torch.equal(trimmed.sequences[:, -3:], sequences[:, 4:7])


@pytest.mark.parametrize("overrides,message", [
    (["stage=grpo", "ppo.advantage=gae"], "ppo.advantage='gae' must be one of grpo, rloo"),
    (["ppo.advantage=rloo"], "ppo.advantage=rloo compares the samples of a prompt"),
    (["ppo.scale_rewards=none"], "ppo.scale_rewards=none scales grpo's advantages"),
    (["ppo.loss_agg=seq_mean"], "ppo.loss_agg='seq_mean' is not one of token_mean"),
    (["ppo.clip_ratio_c=1.0"], "ppo.clip_ratio_c=1.0 must be > 1"),
    (["stage=grpo", "ppo.advantage=grpo", "ppo.rollout.n_samples_per_prompt=2", "ppo.critic.warmup_steps=2"],
     "and 0 without a critic"),
    (["ppo.overlong.buffer=64"], "ppo.overlong.buffer=64 must be in [0, ppo.rollout.max_new_tokens"),
    (["ppo.reward.function=null"], "set ppo.reward.model"),
    (["ppo.reward.model=/somewhere", "ppo.reward.normalize=true"], "normalises a reward model's score alone"),
    (["ppo.reward.function=nocolon"], "must be module:attribute"),
    (["ppo.advantage=grpo"], "n_samples_per_prompt=1 must be >= 2"),
    (["ppo.rollout.temperature=0"], "ppo.rollout.temperature=0.0 must be > 0"),
    (["model.dropout=0.1"], "model.dropout=0.1 must be 0"),
    (["model.attn_implementation=sdpa_segments"], "ignores padding masks"),
    (["trainer.grad_accum_steps=2"], "trainer.grad_accum_steps=2 must be 1"),
    (["ppo.mini_batch_size=48"], "ppo.mini_batch_size=48"),
    (["ppo.critic.init=reward"], "ppo.critic.init=reward"),
    (["ppo.reward.normalize=true"], "ppo.reward.normalize=true"),
    (["data=reverse_prefs"], "data.format='preference'"),
    (["backend=fsdp2_tp"], "backend.tp=2"),
    (["ppo.kl.in_reward=false"], "ppo.kl.estimator=k1 as a loss term"),  # ppo's default estimator: no gradient
    (["ppo.kl.coef=0", "ppo.kl.target=0.1"], "ppo.kl.coef, which is 0 and would stay 0"),
    (["ppo.filter_groups=true"], "ppo.filter_groups=true drops the groups whose scores all agree: it needs "
                                 "ppo.rollout.n_samples_per_prompt >= 2"),
])
def test_bad_ppo_configs_name_the_field_and_the_fix(overrides, message):
    cfg = compose_config(["recipe=ppo_tiny", *overrides])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate(cfg, world_size=2)


def test_prompts_per_step_must_split_over_the_data_parallel_ranks():
    cfg = compose_config(["recipe=ppo_tiny", "ppo.rollout.prompts_per_step=5"])
    with pytest.raises(ConfigError, match="prompts_per_step=5 must be a positive multiple of the data-parallel size 2"):
        validate(cfg, world_size=2)


def test_reversal_reward():
    assert reversal_score(["reverse: abc\n"] * 3, ["cba", "cbx", "cbaaa"]) == [1.0, 0.5 * 2 / 3, 0.5 * 3 / 5]
    assert reversal_score(["reverse: abc\n"], ["xyz"], response=["xyz"]) == [1.0]  # the reference column wins


def test_trl_style_reward_functions_are_called_by_keyword():
    """TRL calls reward functions by keyword (`prompts=`, `completions=`, the columns): a function written for
    TRL gets the responses as `completions`, not the prompts; arrays and tensors of scores are accepted."""
    import numpy as np

    def completions_only(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def trl_named(prompts, completions, answer):
        return np.array([float(c == a) for c, a in zip(completions, answer)], dtype=np.float32)

    def as_tensor(prompts, responses):
        return torch.tensor([1.5, -0.5])

    columns = {"answer": ["a", "b"]}
    assert call_reward_function(completions_only, ["pp", "qq"], ["a", "xyz"], columns) == [1.0, 3.0]
    assert call_reward_function(trl_named, ["p", "q"], ["a", "x"], columns) == [1.0, 0.0]
    assert call_reward_function(as_tensor, ["p", "q"], ["a", "x"], columns) == [1.5, -0.5]
    with pytest.raises(ValueError, match="non-numeric"):
        call_reward_function(lambda p, r: ["1.0", 2.0], ["p", "q"], ["a", "x"], {})
    assert call_reward_function(lambda p, r: [None, 2.0], ["p", "q"], ["a", "x"], {}) == [None, 2.0]
    assert call_reward_function(lambda p, r: [True, False], ["p", "q"], ["a", "x"], {}) == [1.0, 0.0]  # bools count
    assert call_reward_function(lambda **kw: [len(kw["completions"][0]), len(kw["prompts"])], ["p", "q"], ["ab", "x"],
                                {}) == [2.0, 2.0]


def completions_of(prompts, texts, **columns):
    from transformers import TrainerState

    from llmtrain.stages.ppo.rewards import Completions

    return Completions(prompts=prompts, texts=texts, ids=[[ord(c) for c in t] + [0] for t in texts], columns=columns,
                       trainer_state=TrainerState(global_step=7))


def test_trl_reward_functions_run_unchanged_on_chat_and_text_prompts():
    """TRL's own reward functions (trl.rewards) by TRL's calling convention: completions as strings for text
    prompts, as [{"role": "assistant", "content": ...}] for chat prompts, plus completion_ids and trainer_state."""
    from trl.rewards import think_format_reward

    from llmtrain.stages.ppo.rewards import RewardFunction, combined_scores

    chat = [[{"role": "user", "content": "what is 2+2?"}]] * 2
    texts = ["<think>\nadd them\n</think>\n4", "4"]
    think = [RewardFunction("trl.rewards:think_format_reward", think_format_reward)]
    assert combined_scores(think, completions_of(chat, texts))[0] == [1.0, 0.0]
    # text prompts: completions as strings (TRL's soft overlong punishment reads completion_ids)
    from trl.rewards import get_soft_overlong_punishment

    overlong = RewardFunction("overlong", get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2))
    # the ids include the stop token: 3 ids is one past max_completion_len - cache = 2, 6 past the length
    assert combined_scores([overlong], completions_of(["p", "q"], ["ab", "abcde"]))[0] == [-0.5, -1.0]
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.update(completions=completions, ids=completion_ids, step=trainer_state.global_step, kwargs=kwargs)
        return [1.0] * len(completions)

    combined_scores([RewardFunction("spy", spy)], completions_of(chat, ["ab", "c"], answer=["4", "4"]))
    assert seen == {"completions": [[{"role": "assistant", "content": "ab"}], [{"role": "assistant", "content": "c"}]],
                    "ids": [[97, 98, 0], [99, 0]], "step": 7, "kwargs": {"answer": ["4", "4"]}}


def test_several_reward_functions_are_weighted_and_none_is_skipped():
    from llmtrain.stages.ppo.rewards import RewardFunction, combined_scores

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def only_short(completions, **kwargs):
        return [1.0 if len(c) < 3 else None for c in completions]  # None: not this function's business

    functions = [RewardFunction("length", length, 0.5), RewardFunction("only_short", only_short, 2.0)]
    scores, means = combined_scores(functions, completions_of(["p", "q"], ["ab", "abcd"]))
    assert scores == [0.5 * 2 + 2.0 * 1, 0.5 * 4] and means == {"length": 3.0, "only_short": 1.0}
    with pytest.raises(ValueError, match="reward function never scored none of the step's responses"):
        combined_scores([RewardFunction("never", lambda completions, **kw: [None, math.nan])],
                        completions_of(["p", "q"], ["a", "b"]))


def test_reward_function_means_are_global_over_the_data_parallel_ranks(tmp_path):
    """Two gloo ranks score different responses: each function's mean is its sum over the count of the responses it
    scored on every rank (one all-reduce), the same on both ranks; a function that scores none of one rank's
    responses is fine, one that scores none anywhere is an error on both ranks (neither waits for the other)."""
    import json

    import torch.multiprocessing as mp

    from tests.unit.workers.reward_means import score

    mp.spawn(score, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = {"my_rewards:length": (2 + 4 + 6) / 3, "my_rewards:only_short": 1.0}  # not rank 0's 3.0, rank 1's 6.0
    assert [r["means"] for r in ranks] == [expected, expected]
    assert ranks[0]["metrics"] == {"score_fn_length": 4.0, "score_fn_only_short": 1.0}
    assert [r["totals"] for r in ranks] == [[0.5 * 2 + 2.0, 0.5 * 4], [0.5 * 6]]  # each rank's own responses
    assert all("reward function my_rewards:never scored none of the step's responses" in r["error"] for r in ranks)


# ---- the KL: in the reward under GRPO, the adaptive coefficient in the loss, no reference at β = 0 (issue 21) -------

def test_grpo_with_the_kl_in_the_reward_normalises_the_penalised_returns():
    """kl.in_reward=true under GRPO: each sample's return is its score − β·ΣKL, group-normalised (verl's
    use_kl_in_reward); the advantages move with β (they were the same at β = 0 and 50) and equal the hand
    computation."""
    from llmtrain.losses.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, group_advantages, token_rewards

    g = torch.Generator().manual_seed(0)
    scores, kl = torch.rand(8, generator=g), torch.rand(8, 5, generator=g)
    mask = torch.ones(8, 5, dtype=torch.bool)
    mask[0, 3:] = False
    advantages = {}
    for beta in (0.0, 50.0):
        inputs = AdvantageInputs(token_rewards=token_rewards(kl, scores, mask, beta), values=None, mask=mask,
                                 scores=scores, group_size=4, gamma=1.0, lam=1.0)
        advantages[beta] = ADVANTAGE_ESTIMATORS["grpo"](inputs)[0]
        expected = group_advantages(scores - beta * (kl * mask).sum(-1), 4)
        torch.testing.assert_close(advantages[beta], torch.where(mask, expected.unsqueeze(1), 0.0))
    assert torch.equal(advantages[0.0][:, 0], group_advantages(scores, 4))  # without the KL: exactly the scores'
    assert not torch.allclose(advantages[0.0], advantages[50.0])


def grpo_stage(*overrides):
    from llmtrain.models.load import load_tokenizer
    from llmtrain.stages.registry import build_stage

    cfg = compose_config(["recipe=grpo_tiny", *overrides])
    validate(cfg, world_size=1)
    return build_stage(cfg, load_tokenizer(str(TOKENIZER_DIR), trust_remote_code=False), "sdpa")


def test_the_kl_coefficient_of_the_loss_term_is_the_controllers():
    """kl.in_reward=false: the controller starts at ppo.kl.coef (it started at 0 and stayed there with a target)
    and the loss term's β is its value, fixed or adaptive."""
    fixed = grpo_stage()
    assert fixed.kl_controller.value == 0.01 and fixed.update.kl_in_loss  # grpo_tiny: β = 0.01 (it was 0)
    adaptive = grpo_stage("ppo.kl.target=0.01")
    assert adaptive.kl_controller.value == 0.01
    adaptive.kl_controller.update(0.02, 100)  # twice the target: β grows
    assert adaptive.kl_controller.value > 0.01


def test_no_reference_role_when_beta_is_zero():
    from llmtrain.stages.registry import stage_roles

    assert "reference" in stage_roles(compose_config(["recipe=grpo_tiny"]))
    assert sorted(stage_roles(compose_config(["recipe=grpo_tiny", "ppo.kl.coef=0"]))) == ["actor"]
    assert "reference" in stage_roles(compose_config(["recipe=ppo_tiny", "ppo.kl.coef=0", "ppo.kl.target=0.1"]))


@pytest.mark.parametrize("use_cache", [True, False])  # the lean sampling loop; HF generate (one config for all calls)
def test_generation_in_batches_gives_the_same_greedy_rollout(use_cache, tiny_llama):
    """ppo.rollout.generation_batch_size: the rank's sequences go through generate a few at a time (the KV cache of
    only that many at once); greedy, the rollout equals the one-call rollout (rows cut short pad after their EOS)."""
    from llmtrain.backends.ddp import DDPBackend
    from llmtrain.distributed import DistContext
    from llmtrain.stages.ppo.rollout import SamplingSettings, generate

    model = tiny_llama(attn_implementation="sdpa", vocab_size=64, hidden_size=32, intermediate_size=64,
                       pad_token_id=0, eos_token_id=1)
    actor = DDPBackend(DistContext(0, 0, 1, torch.device("cpu")), "fp32").wrap(model, None)
    g = torch.Generator().manual_seed(1)
    batch = collate_prompts([{"prompt_ids": torch.randint(2, 64, (n,), generator=g).tolist(), "prompt": str(n),
                              "columns": {}} for n in (3, 7, 5, 4, 6)], pad_token_id=0)
    def rollout(size: int, eos_ids: list[int]):
        settings = SamplingSettings(max_new_tokens=12, temperature=0.0, n_samples_per_prompt=2, batch_size=size,
                                    use_cache=use_cache)
        return generate(actor, batch, settings, pad_token_id=0, eos_ids=eos_ids, seed=3)

    eos = int(rollout(0, [1]).responses[0, 2])  # a token the first prompt's greedy reply produces early
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                           with_kwargs=True)
    whole, whole_rows = rollout(0, [eos]), set(rows)
    rows.clear()
    batched = rollout(3, [eos])
    hook.remove()
    assert whole_rows == {10} and set(rows) == {3, 1}  # 10 sequences: 3 + 3 + 3 + 1 per forward
    assert whole.ended.any() and whole.action_mask.sum(-1).min() < 12  # some rows stop early
    for field in ("sequences", "attention_mask", "action_mask", "ended"):
        assert torch.equal(getattr(whole, field), getattr(batched, field)), field



def test_dapo_overlong_penalty_by_hand():
    """max_new_tokens 10, buffer 4, penalty 0.5: lengths ≤ 6 pay nothing, 8 pays 0.5·2/4, 10 the whole 0.5."""
    shaping = ScoreShaping(overlong_buffer=4, overlong_penalty=0.5, max_new_tokens=10)
    scores = shaping.apply(torch.ones(4), ended=torch.ones(4, dtype=torch.bool), lengths=torch.tensor([3, 6, 8, 10]))
    torch.testing.assert_close(scores, torch.tensor([1.0, 1.0, 0.75, 0.5]))


def test_truncated_responses_train_nothing_but_their_scores_count():
    """ppo.mask_truncated: the row cut at max_new_tokens loses its action tokens (no loss of any kind) after its score
    entered the group's statistics: the other row's advantage is what it was."""
    from llmtrain.stages.ppo.experience import without_truncated

    mask = torch.ones(2, 3, dtype=torch.bool)
    filled = torch.full((2, 3), 0.7)
    exp = Experience(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long), mask, filled, filled,
                     filled, filled, torch.tensor([[1.0] * 3, [-1.0] * 3]), filled, torch.tensor([1.0, 0.0]), filled,
                     torch.tensor([True, False]))
    masked = without_truncated(exp)
    assert masked.action_mask.tolist() == [[True] * 3, [False] * 3]
    assert torch.equal(masked.advantages, torch.tensor([[1.0] * 3, [0.0] * 3]))
    assert masked.old_logps[1].abs().sum() == 0 and masked.ref_logps[1].abs().sum() == 0
    assert torch.equal(masked.kl, exp.kl) and torch.equal(masked.sampled_mask, mask)  # the rollout as sampled
    assert torch.equal(masked.scores, exp.scores)


# ---- the RL audit: unscored rows, REINFORCE++ needs whitening, metrics of the rollout as sampled, GSPO's default -----

def test_a_row_no_reward_function_scores_is_nan_as_trl():
    """TRL 1.16: nansum over the functions, NaN where every function returned None (the row is then out of its
    group's statistics, advantage 0); before, such a row scored 0."""
    from llmtrain.stages.ppo.rewards import RewardFunction, combined_scores

    def only_short(completions, **kwargs):
        return [1.0 if len(c) < 3 else None for c in completions]

    def only_long(completions, **kwargs):
        return [2.0 if len(c) > 4 else None for c in completions]

    functions = [RewardFunction("only_short", only_short), RewardFunction("only_long", only_long, 0.5)]
    scores, _ = combined_scores(functions, completions_of(["p"] * 3, ["ab", "abcd", "abcdef"]))
    assert scores[0] == 1.0 and math.isnan(scores[1]) and scores[2] == 1.0


def audit_experience(scores, lengths, ended, width=6, kl=0.1):
    """Rows of prompt 2 and `width` response columns, each with `lengths[i]` action tokens and KL `kl` on each."""
    rows = len(scores)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, A)
    zeros = torch.zeros(rows, width)
    return Experience(sequences=torch.full((rows, 2 + width), 5), attention_mask=torch.cat(
        [torch.ones(rows, 2, dtype=torch.long), mask.long()], 1), action_mask=mask, old_logps=zeros, ref_logps=zeros,
        values=zeros, token_rewards=zeros, advantages=zeros, returns=zeros, scores=torch.tensor(scores),
        kl=torch.where(mask, kl, 0.0), ended=torch.tensor(ended))


@pytest.mark.parametrize("advantage,whiten,expected", [
    ("grpo", False, [-1 / 1.0001, 0.0, 1 / 1.0001, 0.0]),  # group (1, –, 3, 2): mean 2, std 1
    ("reinforce_pp", True, [-1.5 ** 0.5, 0.0, 1.5 ** 0.5, 0.0]),  # whitened over the scored rows: mean 2, var 2/3
])
def test_make_experience_gives_unscored_rows_no_advantage(advantage, whiten, expected):
    from llmtrain.stages.ppo.experience import ExperienceSettings, make_experience

    settings = ExperienceSettings(temperature=1.0, kl_estimator="k3", kl_in_reward=False, advantage=advantage,
                                  gamma=1.0, lam=1.0, whiten_advantages=whiten, group_size=4, micro_batch_size=4,
                                  old_logps_from_update=True)
    exp = audit_experience([1.0, math.nan, 3.0, 2.0], [3, 3, 3, 3], [True] * 4)
    made = make_experience(exp, {}, [], 0.0, settings)
    torch.testing.assert_close(made.advantages[:, :3], torch.tensor(expected).unsqueeze(1).expand(4, 3),
                               atol=1e-4, rtol=0)
    assert made.token_rewards.isfinite().all() and math.isnan(made.scores[1])


def test_score_metrics_leave_unscored_rows_out_as_trl():
    """TRL logs nanmean / nanstd of the rewards: an unscored row is out of `score`, `score_std` and `reward`."""
    stage = grpo_stage()
    raw = torch.tensor([1.0, math.nan, 3.0, 2.0])
    metrics = stage._rollout_metrics(audit_experience(raw.tolist(), [3] * 4, [True] * 4), raw, 0.0)
    assert metrics["score"] == pytest.approx(2.0) and metrics["reward"] == pytest.approx(2.0)
    assert metrics["score_std"] == pytest.approx((2 / 3) ** 0.5)


def test_masking_truncated_responses_leaves_the_rollout_metrics_as_sampled():
    """ppo.mask_truncated on 2 rows, lengths 3 (ended) and 6 (cut), KL 0.1 per token: response_len 4.5 and kl 0.45
    per sequence, what was sampled (the adaptive KL controller reads `kl`); before, 1.5 and 0.15."""
    from llmtrain.stages.ppo.experience import without_truncated

    stage = grpo_stage("ppo.kl.in_reward=true", "ppo.kl.estimator=k1")
    masked = without_truncated(audit_experience([1.0, 0.0], [3, 6], [True, False]))
    assert masked.action_mask[1].sum() == 0
    metrics = stage._rollout_metrics(masked, torch.tensor([1.0, 0.0]), 0.5)
    assert metrics["response_len"] == pytest.approx(4.5) and metrics["kl"] == pytest.approx(0.45)
    assert metrics["kl_token"] == pytest.approx(0.1) and metrics["reward"] == pytest.approx(0.5 - 0.5 * 0.45)


def test_reinforce_pp_refuses_to_train_unwhitened():
    """stage=grpo presets ppo.whiten_advantages=false (the group's std scales grpo's advantages); REINFORCE++ is
    normalised by the whitening alone, so its estimators under it are an error naming the field and the fix."""
    for advantage in ("reinforce_pp", "reinforce_pp_baseline", "reinforce_pp_baseline_verl"):
        cfg = compose_config(["recipe=grpo_tiny", f"ppo.advantage={advantage}"])
        with pytest.raises(ConfigError, match=f"ppo.advantage={advantage} .* set ppo.whiten_advantages=true"):
            validate(cfg, world_size=1)
        validate(compose_config(["recipe=grpo_tiny", f"ppo.advantage={advantage}", "ppo.whiten_advantages=true"]),
                 world_size=1)


def test_gspo_takes_the_sequence_mean_unless_loss_agg_is_set():
    assert grpo_stage().update.loss_agg == "token_mean"
    assert grpo_stage("ppo.ratio=sequence").update.loss_agg == "seq_mean_token_mean"
    assert grpo_stage("ppo.ratio=sequence", "ppo.loss_agg=token_mean").update.loss_agg == "token_mean"
    assert grpo_stage("ppo.loss_agg=dr_grpo").update.loss_agg == "dr_grpo"
