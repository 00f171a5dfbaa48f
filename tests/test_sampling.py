"""The sampling math on hand-made distributions: warping, truncation, verification."""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import (
    GREEDY_BELOW,
    RoundOutcome,
    SamplingParams,
    coupled_choice,
    gumbel_noise,
    propose_token,
    residual,
    sample,
    truncate,
    verify_greedy,
    verify_round,
    verify_sampled,
    warp,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_temperature_only_is_softmax_of_scaled_logits():
    assert torch.allclose(warp(LOGITS, SamplingParams(temperature=0.5)), torch.softmax(LOGITS / 0.5, -1))


def test_top_k_keeps_the_k_most_likely():
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_k=3))
    assert (probs[:3] > 0).all() and (probs[3:] == 0).all()
    assert probs.sum() == pytest.approx(1.0)
    assert torch.allclose(probs[:3], torch.softmax(LOGITS[:3], -1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = torch.softmax(LOGITS, -1)  # 0.53, 0.20, 0.12, 0.07, ...
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    kept = (probs > 0).nonzero().flatten().tolist()
    assert kept == [0, 1]  # 0.53 < 0.7 <= 0.53 + 0.20
    assert torch.allclose(probs[:2], full[:2] / full[:2].sum())
    # the most likely token survives even a tiny top_p
    assert (warp(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6)) > 0).nonzero().flatten().tolist() == [0]


def test_truncate_renormalises_the_top_support():
    probs = torch.softmax(LOGITS, -1)
    ids, q = truncate(probs, 2)
    assert ids.tolist() == [0, 1]
    assert torch.allclose(q, probs[:2] / probs[:2].sum())
    ids, q = truncate(torch.tensor([0.5, 0.0, 0.5]), 3)  # zero-probability tokens are left out
    assert sorted(ids.tolist()) == [0, 2]


def test_greedy_accepts_the_matching_prefix():
    logits = torch.eye(5)[[1, 2, 3, 4]]  # target argmax at positions 0..3: 1, 2, 3, 4
    assert verify_greedy(logits, [1, 2, 3]) == RoundOutcome(3, 4)  # all accepted, bonus 4
    outcome = verify_greedy(logits, [1, 0, 3])
    assert (outcome.accepted, outcome.token) == (1, 2)  # correction at the first mismatch
    assert verify_greedy(logits[:1], []) == RoundOutcome(0, 1)  # target-only step


def test_sampled_accepts_everything_when_the_draft_is_the_target():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 8, generator=gen), -1)
    support_ids, support_probs = [list(range(8))] * 3, p[:3].tolist()  # q = p, whole
    for _ in range(200):
        draft = [sample(row, gen) for row in p[:3]]
        assert verify_sampled(p, draft, support_ids, support_probs, gen).accepted == 3


def test_sampled_rejects_tokens_the_target_cannot_emit():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for _ in range(200):
        outcome = verify_sampled(p, [0], [[0]], [[1.0]], gen)  # q puts all its mass on token 0
        assert outcome.accepted == 0 and outcome.token in (1, 2)


def test_residual_is_the_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))


def test_propose_token_is_argmax_when_greedy_and_in_support_when_sampling():
    gen = torch.Generator().manual_seed(0)
    assert propose_token(LOGITS, SamplingParams(), 4, gen).id == 0
    for _ in range(50):
        choice = propose_token(LOGITS, SamplingParams(temperature=1.0), 3, gen)
        assert choice.support_ids == [0, 1, 2] and choice.id in choice.support_ids
        assert sum(choice.support_probs) == pytest.approx(1.0)
        assert len(choice.support_ids) == 3


def test_verify_round_uses_the_sparse_q():
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.1, 0.9], [0.5, 0.5]]))
    # q(1) = 1 and p(1) = 0.9: token 1 is accepted with probability 0.9
    accepted = sum(
        verify_round(logits, SamplingParams(temperature=1.0), [1], [[1]], [[1.0]], gen).accepted for _ in range(4000)
    )
    assert accepted / 4000 == pytest.approx(0.9, abs=0.02)


def test_sample_draws_in_proportion_and_never_a_token_of_zero_probability():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.0])  # any positive total: 10
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(20_000)]), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    assert (counts[[1, 3, 4]] / 20_000).tolist() == pytest.approx([0.3, 0.1, 0.6], abs=0.015)
    assert sample(torch.tensor([0.0, 0.0, 2.0]), gen) == 2
    with pytest.raises(ValueError):
        sample(torch.zeros(3), gen)


@pytest.mark.parametrize("temperature", [0.0, 1e-45, 1e-40, 1e-38, 1e-6])
def test_temperatures_below_the_threshold_decode_greedily(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    gen = torch.Generator().manual_seed(0)
    assert propose_token(LOGITS, params, 4, gen).id == 0
    assert verify_round(LOGITS[None].repeat(2, 1), params, [0], [[]], [[]], gen) == RoundOutcome(1, 0)


def test_the_smallest_sampled_temperature_warps_without_overflow():
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    big = torch.tensor([3e4, -3e4, 0.0, 1.0])  # logits far apart, divided by 1e-5
    probs = warp(big, SamplingParams(temperature=GREEDY_BELOW, top_p=0.5))
    assert torch.isfinite(probs).all() and probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_gumbel_noise_is_a_function_of_seed_and_position_alone():
    both = gumbel_noise(7, 3, 2, 50)
    assert torch.equal(both[0], gumbel_noise(7, 3, 1, 50)[0])  # whatever block a position is drawn in
    assert torch.equal(both[1], gumbel_noise(7, 4, 1, 50)[0])
    assert not torch.equal(both[0], both[1])
    assert not torch.equal(both[0], gumbel_noise(8, 3, 1, 50)[0])


def test_coupled_choice_draws_from_the_warped_distribution_over_seeds():
    params = SamplingParams(temperature=0.8, top_k=4)
    want = warp(LOGITS, params)
    noises = (gumbel_noise(seed, 0, 1, 6)[0] for seed in range(20_000))
    draws = torch.tensor([int(coupled_choice(LOGITS, params, noise)) for noise in noises])
    counts = torch.bincount(draws, minlength=6)
    assert counts[4:].tolist() == [0, 0]  # outside top-k: never
    assert (counts.double() / 20_000).tolist() == pytest.approx(want.tolist(), abs=0.015)


def test_coupled_verification_emits_what_target_only_decoding_would():
    """Whatever the draft proposes, the round emits the target's coupled choices: the
    accepted prefix is exactly where the draft agreed with them."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    for seed in range(200):
        logits = torch.randn(4, 6, generator=gen)
        noise = gumbel_noise(seed, 0, 4, 6)
        target_choices = coupled_choice(logits, params, noise).tolist()
        draft = [c if torch.rand((), generator=gen) < 0.7 else (c + 1) % 6 for c in target_choices[:3]]
        outcome = verify_round(logits, params, draft, [[]] * 3, [[]] * 3, gen, noise)
        emitted = draft[: outcome.accepted] + [outcome.token]
        assert emitted == target_choices[: len(emitted)]
        assert outcome.accepted == next((i for i in range(3) if draft[i] != target_choices[i]), 3)
