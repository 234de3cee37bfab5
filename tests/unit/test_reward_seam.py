"""The pieces under the pairwise stages: scores pooled at the EOS, padding-side invariance, pair collation,
seeded init, the role layout check and the stages' config checks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from llmtrain.compose import compose_config
from llmtrain.config import ConfigError
from llmtrain.models.heads import scores_at, sequence_scores
from llmtrain.models.init import module_seed, seeded_init
from llmtrain.models.load import load_tokenizer, use_distinct_pad_token
from llmtrain.roles import check_same_data_parallel
from llmtrain.stages.preference import collate_pairs, last_token_index
from llmtrain.validation import config_problems
from tests import helpers
from tests.helpers import TOKENIZER_DIR

EOS, PAD_AS_EOS = 257, 257


def tiny_classifier(pad_token_id: int = PAD_AS_EOS, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = helpers.tiny_llama_config(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                       num_key_value_heads=1, num_labels=1, pad_token_id=pad_token_id)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation=attn).eval()


def test_scores_are_taken_at_the_eos_even_when_pad_is_eos():
    """transformers pools at the last token that is not the pad id: with pad == eos, the token before the EOS."""
    model = tiny_classifier()
    ids = torch.tensor([[1, 40, 41, 42, EOS, PAD_AS_EOS, PAD_AS_EOS], [1, 50, 51, 52, 53, 54, EOS]])  # (2, 7)
    lengths = torch.tensor([5, 7])
    mask = (torch.arange(7)[None] < lengths[:, None]).long()
    with torch.no_grad():
        ours = sequence_scores(model, model, lengths - 1, input_ids=ids, attention_mask=mask)
        per_token = model.score(model.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0]  # (2, 7)
        transformers_pooled = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert last_token_index(mask).tolist() == [4, 6]
    assert torch.equal(ours, per_token[torch.arange(2), torch.tensor([4, 6])])
    assert torch.equal(transformers_pooled, per_token[torch.arange(2), torch.tensor([3, 5])])  # one token early
    assert not torch.allclose(ours, transformers_pooled)


def test_left_and_right_padding_give_the_same_scores():
    model = tiny_classifier()
    rows = [[1, 40, 41, EOS], [1, 50, 51, 52, 53, 54, EOS]]
    width = 7
    right = torch.tensor([r + [PAD_AS_EOS] * (width - len(r)) for r in rows])
    left = torch.tensor([[PAD_AS_EOS] * (width - len(r)) + r for r in rows])
    right_mask, left_mask = (right != -1).long(), (left != -1).long()
    right_mask[0, 4:], left_mask[0, :3] = 0, 0
    with torch.no_grad():
        scores = [sequence_scores(model, model, last_token_index(mask), input_ids=ids, attention_mask=mask,
                                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
                  for ids, mask in ((right, right_mask), (left, left_mask))]
    assert last_token_index(left_mask).tolist() == [6, 6]
    torch.testing.assert_close(scores[0], scores[1], rtol=0, atol=1e-4)


def test_scores_are_read_at_flat_positions_one_per_sequence():
    """What the score layer outputs, (B, T, 1), read at flat positions (rows 0, 1, 2 at columns 0, 3, 1)."""
    values = torch.arange(12.0).reshape(3, 4, 1)
    score = torch.nn.Identity()
    holder = torch.nn.Module()
    holder.score = score
    assert scores_at(score, holder, torch.tensor([0, 7, 9]), input=values).tolist() == [0.0, 7.0, 9.0]


PAIRS = [{"chosen_input_ids": [1, 5, 6, EOS], "chosen_labels": [-100, 5, 6, EOS], "rejected_input_ids": [1, 5, EOS],
          "rejected_labels": [-100, 5, EOS], "margin": 0.5, "kind": "hard"},
         {"chosen_input_ids": [1, 7, EOS], "chosen_labels": [-100, 7, EOS], "rejected_input_ids": [1, 8, 9, 9, EOS],
          "rejected_labels": [-100, 8, 9, 9, EOS], "margin": 0.0, "kind": "easy", "__filler__": True}]


def test_pairs_collate_into_one_batch_chosen_rows_first():
    batch = collate_pairs(PAIRS, pad_token_id=0)
    assert batch.rows.input_ids.shape == (4, 5)
    assert batch.rows.input_ids.flatten()[batch.ends].tolist() == [EOS] * 4
    assert batch.ends.tolist() == [3, 7, 12, 19]
    assert batch.sequence_ids.tolist()[1] == [1, 1, 1, -1, -1]
    assert batch.margin.tolist() == [0.5, 0.0] and batch.hard.tolist() == [True, False]
    assert batch.weight.tolist() == [1.0, 0.0] and batch.num_pairs == 1
    assert (batch.rows.labels[1] == -100).all() and (batch.rows.labels[3] == -100).all()  # the filler pair


def test_padding_free_pairs_score_and_logp_like_padded_ones():
    """The 2P sequences back to back in one row (sdpa_segments keeps them apart): the same rewards and the same
    per-sequence log-probs as right-padded rows."""
    from transformers import AutoModelForCausalLM

    from llmtrain.losses.dpo import packed_sequence_logps
    from llmtrain.models.attention import SEGMENT_ATTENTION, register_segment_attention
    from llmtrain.models.heads import scores_at

    register_segment_attention()
    classifier = tiny_classifier(attn=SEGMENT_ATTENTION)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(classifier.config, attn_implementation=SEGMENT_ATTENTION).eval()
    pairs = [dict(p, __filler__=False) for p in PAIRS]
    padded, packed = (collate_pairs(pairs, 0, padding_free=free).for_attention(SEGMENT_ATTENTION)
                      for free in (False, True))
    assert packed.rows.input_ids.shape == (1, 15) and packed.rows.input_ids.flatten()[packed.ends].tolist() == [EOS] * 4
    with torch.no_grad():
        scores = [scores_at(classifier, classifier, b.ends, **b.rows.model_inputs()) for b in (padded, packed)]
        logps = [packed_sequence_logps(lm(**b.rows.model_inputs()).logits, b.rows.labels, b.sequence_ids, 4)
                 for b in (padded, packed)]
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logps[1], logps[0], rtol=1e-5, atol=1e-6)
    assert (logps[0] < 0).all()


def test_distinct_pad_token_uses_unk_instead_of_eos():
    tokenizer = load_tokenizer(str(TOKENIZER_DIR), False)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    use_distinct_pad_token(tokenizer)
    assert tokenizer.pad_token == "<unk>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) == 263  # no new token, no new embedding row


def test_seeded_init_is_a_function_of_seed_and_names_only():
    first, second = tiny_classifier(), tiny_classifier()
    torch.manual_seed(123)
    second.model.layers[0].mlp.up_proj.weight.data.normal_()  # other values before the init
    seeded_init(first, 7)
    state = torch.random.get_rng_state()
    seeded_init(second, 7)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG stream is untouched
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    std = first.config.initializer_range
    weight = first.model.layers[1].self_attn.q_proj.weight
    assert abs(weight.std().item() - std) < 0.2 * std  # the family's own init: normal(0, initializer_range)
    assert torch.equal(first.model.norm.weight, torch.ones_like(first.model.norm.weight))
    seeded_init(second, 8, modules={"score"})
    assert not torch.equal(first.score.weight, second.score.weight)
    assert torch.equal(first.model.embed_tokens.weight, second.model.embed_tokens.weight)
    assert module_seed(7, "score") != module_seed(8, "score") and module_seed(7, "a") != module_seed(7, "b")


def test_seeded_init_keeps_the_constructors_values_where_the_family_draws_nothing():
    """Apertus's xIELU activation holds parameters (alpha_p, alpha_n) its `_init_weights` leaves to the constructor:
    they keep those values (left as torch.empty they were zeros here, and every gradient of the model was 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("apertus", vocab_size=263, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    constructed, model = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    seeded_init(model, 7)
    xielu = [name for name, _ in model.named_parameters() if name.endswith(("alpha_p", "alpha_n"))]
    assert xielu and all(torch.equal(model.get_parameter(n), constructed.get_parameter(n)) for n in xielu)
    ids = torch.arange(2, 18)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_roles_must_share_the_data_parallel_layout():
    check_same_data_parallel({"policy": (2, 0), "reference": (2, 0)})
    with pytest.raises(ConfigError, match="policy: dp size 2.*reference: dp size 4"):
        check_same_data_parallel({"policy": (2, 0), "reference": (4, 0)})


@pytest.mark.parametrize("overrides, message", [
    (["stage=reward", "data=reverse"], "stage reward trains on pairs: data.format='prompt_response'"),
    (["stage=dpo", "dpo.beta=0"], "dpo.beta=0.0 must be > 0"),
    (["stage=dpo", "dpo.loss=kto"], "dpo.loss='kto' is not one of sigmoid, ipo, hinge, robust"),
    (["stage=dpo", "dpo.label_smoothing=0.5"], "dpo.label_smoothing=0.5 must be in"),
    (["stage=reward", "model.dropout=0.1"], "model.dropout=0.1 must be 0"),
    (["stage=reward", "data.packing=true"], "data.packing=true packs single sequences"),
    (["stage=reward", "reward.center_coef=-1"], "reward.center_coef=-1.0 must be >= 0"),
])
def test_pair_stage_config_errors_name_the_field(overrides, message):
    cfg = compose_config(["recipe=sft_tiny", "data=reverse_prefs", *overrides])
    problems = config_problems(cfg, world_size=1)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("stage", ["pretrain", "sft", "reward", "dpo"])
def test_planner_roles_agree_with_the_stages(stage):
    """The planner's role table (read before any stage exists) is what each built stage declares."""
    from llmtrain.stages.registry import build_stage, stage_roles

    data = {"pretrain": "data=grammar", "sft": "data=reverse", "reward": "data=reverse_prefs",
            "dpo": "data=reverse_prefs_easy"}[stage]
    cfg = compose_config(["recipe=sft_tiny", f"stage={stage}", data, "data.packing=false"])
    built = build_stage(cfg, load_tokenizer(str(TOKENIZER_DIR), False), "sdpa_segments")
    assert ({role: spec.trainable for role, spec in built.roles.items()}
            == {role: spec.trainable for role, spec in stage_roles(cfg).items()})
