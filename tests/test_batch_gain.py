"""The batch chooser (specdec.batch_gain) against brute force and against the
single-session formula it generalises."""

from __future__ import annotations

import itertools
import random

import pytest

from specdec.batch_gain import StepCosts, choose_ks, goodput
from specdec.speculation_gain import best_k


def brute_force(alphas: list[float], costs: StepCosts, k_max: int) -> tuple[float, list[tuple[int, ...]]]:
    """The best goodput over every k in 0..k_max per session, and every k reaching it."""
    scored = [(goodput(alphas, ks, costs), ks) for ks in itertools.product(range(k_max + 1), repeat=len(alphas))]
    best = max(value for value, _ in scored)
    return best, [ks for value, ks in scored if value >= best * (1 - 1e-9)]


def random_costs(rng: random.Random) -> StepCosts:
    """A forward whose cost per row first stays flat (memory-bound), then grows (compute-bound)."""
    base = rng.uniform(2e-3, 20e-3)
    knee = rng.randint(2, 24)
    slope = rng.uniform(0.0, 0.15) * base
    steep = rng.uniform(0.02, 1.0) * base
    points = [(1, base), (knee, base + slope * (knee - 1)), (knee + 40, base + slope * (knee - 1) + steep * 40)]
    return StepCosts(
        verify_points=tuple(points),
        draft_call=rng.uniform(0.0, 0.5) * base,
        draft_fixed=rng.uniform(0.0, 0.5) * base,
        draft_per_session=rng.uniform(0.0, 0.05) * base,
        rest=rng.uniform(0.0, 0.5) * base,
    )


@pytest.mark.parametrize("seed", range(40))
def test_the_chooser_finds_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    sessions = rng.randint(1, 4)
    alphas = [rng.choice([0.0, 0.05, 0.3, 0.6, 0.8, 0.9, 0.97, 1.0]) for _ in range(sessions)]
    costs, k_max = random_costs(rng), 8
    ks, value = choose_ks(alphas, costs, k_max)
    best, argmaxes = brute_force(alphas, costs, k_max)
    assert value == pytest.approx(best, rel=1e-9)
    assert goodput(alphas, ks, costs) == pytest.approx(best, rel=1e-9)
    if len(argmaxes) == 1:  # a unique optimum: the same choice
        assert tuple(ks) == argmaxes[0]


def test_caps_bound_each_session() -> None:
    costs = StepCosts(verify_points=((1, 10e-3), (40, 12e-3)), draft_fixed=0.5e-3)
    ks, _ = choose_ks([0.9, 0.9, 0.9], costs, k_max=8, caps=[8, 2, 0])
    assert ks[1] <= 2 and ks[2] == 0 and ks[0] > 2


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.7, 0.8, 0.9, 0.95])
def test_one_session_is_the_single_session_formula(alpha: float) -> None:
    """In target-only tokens: c = a draft step / T0, v(k) = (rest + verify(k + 1)) / T0."""
    costs = StepCosts(
        verify_points=((1, 10e-3), (9, 11e-3), (17, 14e-3)), draft_call=1e-3, draft_fixed=1.5e-3, rest=2e-3
    )
    token = costs.step([0])
    c = costs.draft_fixed / token
    v = {k: (costs.rest + costs.draft_call + costs.verify(k + 1)) / token for k in range(1, 9)}
    k, gain = best_k(alpha, c, v, k_max=8)
    ks, value = choose_ks([alpha], costs, k_max=8)
    if gain > 1:
        assert ks == [k]
        assert value * token == pytest.approx(gain)
    else:
        assert ks == [0]


def test_k_shrinks_as_the_forward_becomes_compute_bound() -> None:
    alphas = [0.9, 0.8, 0.7, 0.6]
    chosen = []
    for steep in (0.0, 0.05, 0.2, 0.6, 3.0):  # extra seconds per row, in units of a forward
        points = ((1, 10e-3), (60, 10e-3 + steep * 10e-3 * 59))
        ks, _ = choose_ks(alphas, StepCosts(verify_points=points, draft_fixed=1e-3), k_max=8)
        chosen.append(ks)
    for looser, tighter in itertools.pairwise(chosen):
        assert all(t <= lo for lo, t in zip(looser, tighter)), chosen
    assert sum(chosen[0]) > sum(chosen[-2]) and chosen[-1] == [0, 0, 0, 0], chosen


def test_a_session_whose_drafts_miss_runs_target_only_beside_ones_that_speculate() -> None:
    costs = StepCosts(verify_points=((1, 10e-3), (4, 10.5e-3), (40, 16e-3)), draft_fixed=1.5e-3, rest=1e-3)
    ks, _ = choose_ks([0.9, 0.02, 0.85, 0.0], costs, k_max=8)
    assert ks[1] == 0 and ks[3] == 0
    assert ks[0] > 0 and ks[2] > 0


def test_sessions_with_higher_acceptance_keep_larger_k() -> None:
    costs = StepCosts(verify_points=((1, 10e-3), (8, 10.5e-3), (64, 30e-3)), draft_fixed=1e-3, draft_per_session=1e-4)
    alphas = [0.5, 0.95, 0.7, 0.85, 0.6, 0.9]
    ks, _ = choose_ks(alphas, costs, k_max=8)
    by_alpha = [k for _, k in sorted(zip(alphas, ks))]
    assert by_alpha == sorted(by_alpha) and by_alpha[-1] > by_alpha[0], list(zip(alphas, ks))


@pytest.mark.parametrize("seed", range(20))
def test_sessions_with_their_own_k_or_no_draft_count_in_the_step(seed: int) -> None:
    """A request that asked for its k (floor = cap) or has no draft (cap 0) is not chosen
    for, but its rows are in the step: the others' choice is brute force's over the rest."""
    rng = random.Random(1000 + seed)
    sessions = rng.randint(2, 4)
    alphas = [rng.choice([0.3, 0.6, 0.8, 0.9, 1.0]) for _ in range(sessions)]
    costs, k_max = random_costs(rng), 6
    floors = [0] * sessions
    caps = [k_max] * sessions
    fixed = rng.randrange(sessions)
    floors[fixed] = caps[fixed] = rng.choice([0, 2, 4])
    ks, value = choose_ks(alphas, costs, k_max, caps=caps, floors=floors)
    assert ks[fixed] == floors[fixed]
    allowed = [range(lo, hi + 1) for lo, hi in zip(floors, caps)]
    best = max(goodput(alphas, c, costs) for c in itertools.product(*allowed))
    assert value == pytest.approx(best, rel=1e-9)
