"""A batched step's served costs (verify_service.step_costs) and their calibration
(specdec.costs.batch_forward_seconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdec.costs import batch_forward_seconds, context_ratios
from specdec.runtime import CausalLM, ModelSpec
from verify_service.step_costs import MIN_DRAFT_SAMPLES, ContextCost, ServedStepCosts

# sessions, positions each -> seconds: memory-bound (flat) to 16 rows, then compute-bound
GRID = {(1, 1): 0.010, (1, 4): 0.0105, (1, 16): 0.012, (4, 1): 0.0108, (4, 4): 0.012, (4, 16): 0.030}


def test_a_forward_is_predicted_along_rows_and_between_session_counts() -> None:
    costs = ServedStepCosts(GRID)
    # One session's (4, 0.0105) lies above the chord from 1 to 16 rows: the curve is its lower
    # hull, convex as the chooser needs (measured noise must not make a row look free).
    one_at_4 = 0.010 + (0.012 - 0.010) * 3 / 15
    assert costs.forward(1, 4) == pytest.approx(one_at_4)
    assert costs.forward(4, 16) == pytest.approx(0.012)
    assert costs.forward(4, 10) == pytest.approx(0.0108 + (0.012 - 0.0108) * 6 / 12)
    assert costs.forward(2, 4) == pytest.approx(one_at_4 + (0.0108 - one_at_4) / 3)  # a third of the way to 4
    assert costs.forward(4, 96) == pytest.approx(0.030 + (0.030 - 0.012) / 48 * 32)  # beyond: the last slope
    assert costs.forward(16, 16) == pytest.approx(costs.forward(4, 16))  # beyond the counts: the nearest


def test_served_forwards_scale_the_calibration() -> None:
    costs = ServedStepCosts(GRID)
    for _ in range(5):
        costs.observe_forward(1, 16, 2 * 0.012)
    assert costs.forward(4, 16) == pytest.approx(2 * 0.012)
    costs.observe_forward(4, 16, 2 * 0.012)  # a sample at the served scale keeps it
    assert costs.forward(1, 1) == pytest.approx(2 * 0.010)


def test_a_longer_context_costs_per_session_and_per_row() -> None:
    """Attention reads each session's cached keys (per session) and scores each row against
    them (per row): both fitted from forwards at a longer context, and priced into every
    forward the chooser weighs; served forwards at that context keep the scale at 1."""
    per_session, per_row = 0.5e-6, 0.15e-6  # seconds per further context token
    longer = {(s, p): GRID[s, p] + (per_session * s + per_row * s * p) * 384 for s, p in ((1, 1), (4, 1), (4, 4))}
    slower = {shape: seconds / GRID[shape] for shape, seconds in longer.items()}
    context = ContextCost.fitted(128, GRID, 512, slower)
    assert (context.per_session, context.per_row) == pytest.approx((per_session, per_row))
    assert ContextCost.fitted(128, GRID, 128, slower) == ContextCost(128)  # no longer context measured: no term
    costs = ServedStepCosts(GRID, context)
    assert costs.forward(4, 16, context=128) == pytest.approx(0.012)
    assert costs.forward(4, 16, context=512) == pytest.approx(longer[4, 4])
    assert costs.forward(4, 16, context=0) == pytest.approx(0.012 - (4 * per_session + 16 * per_row) * 128)
    for _ in range(5):
        costs.observe_forward(4, 16, longer[4, 4], context=512)
    assert costs.forward(4, 16, context=512) == pytest.approx(longer[4, 4])
    # The chooser's rows are dearer behind a longer context, each further row by per_row.
    for draft in (2, 4, 3):
        costs.observe_draft(draft, draft, 1e-3 * draft)
    short, long = costs.step_costs(4, k_max=4, context=128), costs.step_costs(4, k_max=4, context=1128)
    assert long.verify(4) - short.verify(4) == pytest.approx((4 * per_session + 4 * per_row) * 1000)
    assert long.verify(20) - short.verify(20) == pytest.approx((4 * per_session + 20 * per_row) * 1000)


def test_the_draft_line_is_fitted_from_batched_steps() -> None:
    costs = ServedStepCosts(GRID)
    call, fixed, per = 0.8e-3, 1.2e-3, 0.15e-3
    samples = [(4, 4), (4, 13), (2, 7), (8, 20), (3, 3), (6, 30)]  # (K, Σk)
    for i, (steps, proposed) in enumerate(samples):
        assert (costs.draft_line() is None) == (i < MIN_DRAFT_SAMPLES)
        costs.observe_draft(steps, proposed, call + fixed * steps + per * proposed)
    assert costs.draft_line() == pytest.approx((call, fixed + per, per), abs=1e-12)


def test_where_all_three_draft_terms_do_not_fit_the_pair_that_fits_best_is_taken() -> None:
    """Waits whose call fits a little negative: of the pairs left, the steps and the
    sessions fit them, not the call and the steps that an order of preference would pick first."""
    costs = ServedStepCosts(GRID)
    samples = [(2, 8), (4, 10), (3, 24), (6, 30), (8, 16), (5, 40)]  # (K, Σk)
    for steps, proposed in samples:
        costs.observe_draft(steps, proposed, -0.1e-3 + 1.2e-3 * steps + 0.3e-3 * (proposed - steps))
    call, first, further = costs.draft_line()
    assert call == 0.0 and first == pytest.approx(1.2e-3, rel=0.05) and further == pytest.approx(0.3e-3, rel=0.05)


def test_a_draft_dear_in_company_prices_every_session_at_once() -> None:
    """Steps of one session, cheap, then one step of six sessions that saturate the draft:
    the line moves from that one step on, and the chooser, whose per-step part is never
    negative, prices a first session of a step cheaper than each further one as a further one."""
    costs = ServedStepCosts(GRID)
    call, first, further = 1e-3, 1.3e-3, 8e-3
    for steps in (2, 4, 3, 5, 9, 6):
        costs.observe_draft(steps, steps, call + first * steps)
    assert costs.draft_line() == pytest.approx((call, first, 0.0), abs=1e-12)
    costs.observe_draft(10, 60, call + (first + 5 * further) * 10)
    assert costs.draft_line() == pytest.approx((call, first, further), abs=1e-12)
    step = costs.step_costs(4, k_max=4)
    assert (step.draft_call, step.draft_fixed, step.draft_per_session) == pytest.approx((call, 0.0, further))


def test_one_session_per_draft_step_fits_a_call_and_a_step() -> None:
    costs = ServedStepCosts(GRID)
    for steps in (2, 4, 3, 5, 1):
        costs.observe_draft(steps, steps, 1e-3 + 1.5e-3 * steps)
    assert costs.draft_line() == pytest.approx((1e-3, 1.5e-3, 0.0), abs=1e-12)


def test_steps_of_one_k_cost_their_wait_per_draft_step() -> None:
    costs = ServedStepCosts(GRID)
    for seconds in (4e-3, 5e-3, 4.5e-3):
        costs.observe_draft(2, 2, seconds)
    assert costs.draft_line() == pytest.approx((0.0, 4.5e-3 / 2, 0.0))


def test_step_costs_price_the_chooser_s_rows_beside_prompt_chunks() -> None:
    costs = ServedStepCosts(GRID)
    assert costs.step_costs(4, k_max=4) is None  # the draft's cost is not known yet
    for steps in (2, 4, 3):
        costs.observe_draft(steps, steps, 1e-3 * steps)
    costs.observe_rest(4, 2e-3)
    step = costs.step_costs(4, k_max=4, other_rows=8)
    assert step is not None and step.rest == pytest.approx(2e-3)
    assert (step.draft_call, step.draft_fixed) == pytest.approx((0.0, 1e-3), abs=1e-12)
    for extra in (0, 5, 16):  # the chooser's rows n + Σk are n + Σk + 8 in the forward
        assert step.verify(4 + extra) == pytest.approx(costs.forward(4, 4 + extra + 8))


def test_a_steps_rest_is_a_fixed_part_plus_one_per_round() -> None:
    costs = ServedStepCosts(GRID)
    assert costs.rest(4) == 0.0
    for sessions in (2, 4, 8, 16, 4):
        costs.observe_rest(sessions, 1e-3 + 0.5e-3 * sessions)
    assert costs.rest(1) == pytest.approx(1.5e-3) and costs.rest(32) == pytest.approx(17e-3)
    # Steps of one size say nothing of the others: their median stands for every size.
    one_size = ServedStepCosts(GRID)
    for seconds in (3e-3, 5e-3, 4e-3):
        one_size.observe_rest(16, seconds)
    assert one_size.rest(1) == one_size.rest(16) == pytest.approx(4e-3)


def test_the_draft_is_charged_what_it_adds_to_the_rest_of_a_step() -> None:
    """The draft computes a step's proposals while the step before hands its chunks over;
    on few cores it slows that, and the wait for the proposals alone misses it. Target-only
    steps' rests are the base; a speculative step's rest beyond them is the draft's."""
    costs, waits_only = ServedStepCosts(GRID), ServedStepCosts(GRID)
    call, per_step, slowed = 5e-3, 0.2e-3, 0.4e-3  # the rest runs slower by 0.4 ms per draft step

    def rest(sessions: int) -> float:
        return 1e-3 + 0.1e-3 * sessions

    for sessions in (4, 8, 16, 8):
        costs.observe_overhead(sessions, rest(sessions))
    for steps, sessions in ((2, 8), (5, 16), (3, 4), (8, 16), (4, 8)):
        wait = call + per_step * steps
        costs.observe_overhead(sessions, rest(sessions) + slowed * steps, steps, steps, wait)
        waits_only.observe_draft(steps, steps, wait)
    assert costs.draft_line() == pytest.approx((call, per_step + slowed, 0.0), abs=1e-9)
    assert waits_only.draft_line() == pytest.approx((call, per_step, 0.0), abs=1e-9)
    # The rest the chooser adds to every step is a target-only step's, the draft's part aside.
    assert costs.rest(8) == pytest.approx(rest(8))
    # Until target-only steps were measured, every step's rest stands for it, the wait for the draft.
    fresh = ServedStepCosts(GRID)
    for steps, sessions in ((2, 8), (5, 16), (3, 4)):
        fresh.observe_overhead(sessions, rest(sessions) + slowed * steps, steps, steps, call + per_step * steps)
    assert fresh.draft_line() == pytest.approx((call, per_step, 0.0), abs=1e-9) and fresh.rest(8) > rest(8)


def test_batch_forwards_are_calibrated_for_the_session_counts_the_pool_holds(toy) -> None:
    model = CausalLM.load(replace(ModelSpec(str(toy.target)), pool_contexts=3, pool_slots=True))
    forwards = model.forwards
    measured = batch_forward_seconds(model, sessions=(1, 2, 4), per_session=(1, 3), context=16, repeats=2)
    assert set(measured) == {(1, 1), (1, 3), (2, 1), (2, 3)}  # four sessions do not fit three slots
    assert all(seconds > 0 for seconds in measured.values())
    assert model.forwards == forwards and model.pool_stats().reserved_tokens == 0  # nothing left behind


def test_a_context_the_pool_cannot_hold_calibrates_nothing(toy) -> None:
    """A small `--kv-pool-tokens` holds no session behind the longer context: that
    calibration is left out (no context term) rather than failing the service's start."""
    model = CausalLM.load(replace(ModelSpec(str(toy.target)), pool_tokens=32))
    assert batch_forward_seconds(model, sessions=(1, 2), per_session=(1, 3), context=64, repeats=1) == {}
    assert model.pool_stats().reserved_tokens == 0


def test_a_longer_context_is_timed_beside_the_shorter_in_sessions_the_pool_holds_at_both(toy) -> None:
    """Five slots hold two sessions at both contexts at once (a fifth slot alone times
    nothing): the ratios are of one session and of two, each a forward behind 120 cached
    tokens over the same forward behind 8; a pool holding no longer context times nothing."""
    model = CausalLM.load(replace(ModelSpec(str(toy.target)), pool_contexts=5, pool_slots=True))
    slower = context_ratios(model, 16, per_session=(1, 3), short=8, longer=120, repeats=2)
    assert set(slower) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(ratio > 0 for ratio in slower.values())
    assert model.pool_stats().reserved_tokens == 0  # nothing left behind
    small = CausalLM.load(replace(ModelSpec(str(toy.target)), pool_tokens=64))
    assert context_ratios(small, 4, per_session=(1, 3), short=8, longer=120, repeats=1) == {}
    assert small.pool_stats().reserved_tokens == 0
