"""Sequence-level unlikelihood (models/unlikelihood.py): which tokens it penalises, the loss
it computes, that a step of it lowers a repeated token's probability, and the fine-tuning
tool end to end at toy scale."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from models import recipe, unlikelihood
from specdec.defaults import DEFAULT_TARGET
from specdec.runtime import CausalLM, ModelSpec


def test_repeated_tokens_are_the_continuations_tokens_inside_a_4gram_seen_before():
    looped = [1, 2, 3, 4, 5, 1, 2, 3, 4, 9]
    assert unlikelihood.repeated_tokens(looped, start=5).tolist() == [False] * 5 + [True] * 4 + [False]
    # a 4-gram repeated within the prefix is the prompt's business, not the continuation's
    assert not unlikelihood.repeated_tokens([1, 2, 3, 4, 1, 2, 3, 4, 7, 8], start=8).any()
    # a repeat straddling the boundary marks only its continuation tokens
    straddle = unlikelihood.repeated_tokens([5, 6, 7, 8, 9, 6, 7, 8, 9], start=6)
    assert straddle.nonzero().flatten().tolist() == [6, 7, 8]


def test_unlikelihood_loss_is_minus_log_one_minus_p_over_all_positions():
    logits = torch.zeros(1, 6, 4)  # p = 1/4 for every token
    tokens = torch.tensor([[0, 1, 2, 3, 0, 1]])
    repeated = torch.tensor([[False, False, True, False, True, False]])
    loss = unlikelihood.unlikelihood_loss(logits, tokens, repeated)
    assert loss.item() == pytest.approx(2 * -math.log(0.75) / 6)
    assert unlikelihood.unlikelihood_loss(logits, tokens, torch.zeros_like(repeated)).item() == 0.0


def test_a_draft_choice_closes_a_repeat_only_with_a_4gram_written_before_it():
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 9, 7, 8, 6, 0]
    # at position 8, after 1 2 3, a draft choosing 4 would repeat 1 2 3 4; choosing 9 would not
    assert unlikelihood.closes_repeat(tokens, 8, [4, 9]).tolist() == [True, False]
    # 7 8 6 0 is written only later, so choosing 0 after 7 8 6 is no repeat yet
    assert not unlikelihood.closes_repeat(tokens, 9, [1, 2, 0]).any()
    # a choice closing a 4-gram of the continuation itself counts too
    assert unlikelihood.closes_repeat([5, 6, 7, 8, 5, 6, 7, 8], 4, [5, 6, 7, 8]).tolist() == [False, False, False, True]


def test_agreement_loss_is_the_cross_entropy_toward_the_choices_over_all_positions():
    logits = torch.zeros(1, 4, 8)  # p = 1/8 for every token
    logits[0, 1, 3] = 10.0
    choices = torch.tensor([[0, 3, 5, 6]])
    counted = torch.tensor([[True, True, False, False]])
    expected = (math.log(8) + torch.log_softmax(logits[0, 1], -1)[3].neg().item()) / 4
    assert unlikelihood.agreement_loss(logits, choices, counted).item() == pytest.approx(expected)
    assert unlikelihood.agreement_loss(logits, choices, torch.zeros_like(counted)).item() == 0.0


def test_an_unlikelihood_step_lowers_the_repeated_tokens_probability():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    rows = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4]])
    repeated = unlikelihood.repeated_tokens(rows[0].tolist(), start=4)[None, 1:]

    def p_repeated() -> torch.Tensor:
        probs = model(input_ids=rows[:, :-1]).logits.softmax(-1).gather(-1, rows[:, 1:, None])[..., 0]
        return probs[repeated].mean()

    before = p_repeated().item()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(3):
        unlikelihood.unlikelihood_loss(model(input_ids=rows[:, :-1]).logits, rows[:, 1:], repeated).backward()
        opt.step()
        opt.zero_grad()
    assert p_repeated().item() < 0.8 * before


def test_fine_tuning_reports_loss_repetition_and_acceptance_and_saves_the_target(tmp_path):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(DEFAULT_TARGET)
    for name, shape in (("target", recipe.TOY.target), ("draft", recipe.TOY.draft)):
        torch.manual_seed(0)
        recipe.save(recipe.new_gpt2(shape, tokenizer, 2048), tokenizer, tmp_path / name)
    tune = unlikelihood.Tune(
        steps=2, evals=1, rows=2, prefix=8, new_tokens=8, eval_tokens=512, distinct_tokens=16, acceptance_tokens=12,
        max_files=6,
    )  # fmt: skip
    points = unlikelihood.run(tune, tmp_path / "target", tmp_path / "draft", tmp_path / "tuned")
    assert [p["step"] for p in points] == [0, 2] and points[1]["tokens"] > 0
    assert all(0 < p["heldout_loss"] < 10 and 0 <= p["distinct_min"] <= p["distinct_mean"] <= 1 for p in points)
    assert all(0 <= p["acceptance"] <= 1 for p in points)
    tuned = CausalLM.load(ModelSpec(str(tmp_path / "tuned"))).model.state_dict()
    original = CausalLM.load(ModelSpec(str(tmp_path / "target"))).model.state_dict()
    assert any(not torch.equal(tuned[name], original[name]) for name in original)
    # the same run pulled toward the draft's choices ends elsewhere: the draft takes part
    pulled = dataclasses.replace(tune, agreement=5.0)
    unlikelihood.run(pulled, tmp_path / "target", tmp_path / "draft", tmp_path / "agreed")
    agreed = CausalLM.load(ModelSpec(str(tmp_path / "agreed"))).model.state_dict()
    assert any(not torch.equal(agreed[name], tuned[name]) for name in tuned)


def test_fine_tuning_refuses_a_pair_trained_on_another_corpus(tmp_path):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(DEFAULT_TARGET)
    recipe.save(recipe.new_gpt2(recipe.TOY.target, tokenizer, 2048), tokenizer, tmp_path / "target")
    (tmp_path / "report.json").write_text(json.dumps({"corpus": {"digest": "0" * 64}}))
    with pytest.raises(ValueError, match="not the corpus"):
        unlikelihood.run(unlikelihood.Tune(steps=1, evals=1), tmp_path / "target", DEFAULT_TARGET, None)
