"""AUTO speculation: the choice of k as a pure function, a session's fall-back and probes,
and, through real services, short requests that never reach the draft and a draft that
keeps missing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from specdec import costs as costs_module
from specdec import defaults
from specdec.costs import forward_seconds
from specdec.speculation_gain import best_k, expected_tokens, gain
from specdec.v1 import common_pb2
from tests.helpers import HeldDecode, draft_info, request, rpc_error, run, verify_info
from verify_service.auto_mode import AutoPolicy, AutoSession, Choice, ServedCosts, ServiceAuto, parse_table

PROMPT = "def parse_header(line):"
LOW_GAIN = common_pb2.AUTO_CHOICE_LOW_GAIN
PROBE = common_pb2.AUTO_CHOICE_PROBE
BEST_K = common_pb2.AUTO_CHOICE_BEST_K
SCHEDULE = common_pb2.AUTO_CHOICE_SCHEDULE
LOAD = common_pb2.AUTO_CHOICE_LOAD
STREAMS = [f"{PROMPT}  # stream {i}: {'abc'[i % 3] * (i + 1)}" for i in range(16)]
PAUSE_BELOW = AutoPolicy().pause_below


def auto_request(max_new_tokens: int, text: str = PROMPT, **fields: object):
    req = request(text, max_new_tokens=max_new_tokens, **fields)
    req.speculation.mode = common_pb2.SPECULATION_MODE_AUTO
    return req


# --- the choice of k, against the formula -------------------------------------------------


def test_gain_is_the_design_formula_on_its_worked_example():
    # docs/design.md: α̂ 0.8, k 4, c 0.1, v 1.05 gives a bound of about 2.3x.
    assert expected_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3 + 0.8**4)
    assert gain(0.8, 4, 0.1, 1.05) == pytest.approx(3.3616 / 1.45, rel=1e-9)
    assert expected_tokens(1.0, 5) == 6.0


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("c", [0.02, 0.1, 0.3])
def test_best_k_maximises_the_formula(alpha: float, c: float):
    v = {k: 1.0 + 0.03 * k + 0.002 * k * k for k in range(1, 17)}
    by_hand = {k: sum(alpha**i for i in range(k + 1)) / (k * c + v[k]) for k in v}
    k, g = best_k(alpha, c, v)
    assert g == pytest.approx(max(by_hand.values()))
    assert k == max(by_hand, key=by_hand.get)


def test_best_k_grows_with_acceptance_and_shrinks_with_draft_cost():
    v = {k: 1.0 + 0.05 * k for k in range(1, 17)}
    ks = [best_k(alpha, 0.1, v)[0] for alpha in (0.5, 0.7, 0.85, 0.95)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert best_k(0.9, 0.02, v)[0] > best_k(0.9, 0.4, v)[0]
    assert best_k(0.9, 0.1, v, k_max=3)[0] == 3


def test_a_draft_that_never_hits_is_expected_to_lose():
    v = {k: 1.0 + 0.05 * k for k in range(1, 17)}
    assert best_k(0.0, 0.1, v)[1] < 1.0  # one token per round, for more than one token's cost
    assert best_k(0.1, 0.1, v)[1] < 1.0
    assert best_k(0.8, 0.1, v)[1] > 1.5


# --- a session's decisions -----------------------------------------------------------------


def costs_measured(costs: ServedCosts, step_s: float = 0.007, draft_per_token_s: float = 0.001) -> ServedCosts:
    """Costs after three speculative rounds (k=4, 3 ms beyond the wait and the forward)
    and three target-only rounds (2 ms beyond the forward), each forward as calibrated."""
    for _ in range(3):
        verify_5 = costs._forward[5]
        costs.observe(4, 4 * draft_per_token_s, verify_5, 4 * draft_per_token_s + verify_5 + 0.003)
        costs.observe(0, 0.0, costs._forward[1], costs._forward[1] + 0.002)
    return costs


def calibration(step_s: float = 0.007) -> dict[int, float]:
    return {n: step_s * (1 + 0.04 * (n - 1)) for n in range(1, 18)}


def test_costs_as_served_give_c_and_v_in_target_only_tokens():
    costs = costs_measured(ServedCosts(calibration()))
    c, v = costs.ratios()
    token = 0.007 + 0.002  # a target-only round: forward plus the rest of the round
    assert c == pytest.approx(0.001 / token)
    assert v[4] == pytest.approx((0.007 * 1.16 + 0.003) / token)
    assert sorted(v) == list(range(1, 17))
    # One proposal that waited 50 ms (a stall) does not move the draft's cost.
    costs.observe(4, 0.050, 0.007 * 1.16, 0.065)
    assert costs.ratios()[0] == pytest.approx(0.001 / token)
    # Speculative forwards served 50% slower than calibrated cost 50% more; target-only
    # ones, measured apart, still as calibrated.
    for _ in range(10):
        costs.observe(2, 0.002, 0.007 * 1.08 * 1.5, 0.002 + 0.007 * 1.08 * 1.5 + 0.003)
    c, v = costs.ratios()
    assert v[4] == pytest.approx((0.007 * 1.16 * 1.5 + 0.003) / token)


def test_the_drafts_wait_is_a_call_plus_a_cost_per_token():
    """A proposal's wait is mostly its call: priced per token, a large k would look dear
    and AUTO would keep choosing the small k it measured at."""
    costs = ServedCosts(calibration())
    forward = calibration()
    for _ in range(3):
        for k in (2, 4):  # each round 3 ms beyond its wait and its forward
            wait = 0.0030 + k * 0.0005
            costs.observe(k, wait, forward[k + 1], wait + forward[k + 1] + 0.003)
        costs.observe(0, 0.0, forward[1], forward[1] + 0.002)
    costs.observe(4, 0.050, forward[5], 0.050 + forward[5] + 0.003)  # one stalled proposal moves nothing
    token = forward[1] + 0.002
    c, v = costs.ratios()
    assert c == pytest.approx(0.0005 / token)
    assert costs.proposal_seconds(8) == pytest.approx(0.0030 + 8 * 0.0005)
    assert v[8] == pytest.approx((forward[9] + 0.003 + 0.0030) / token)
    assert best_k(0.9, c, v)[0] >= 8  # wait / k at k = 2 (2 ms a token) would choose far fewer


def test_sessions_that_ran_at_one_k_take_the_drafts_call_from_another_line():
    """Sampled sessions that only probe (k = 2) cannot tell the call from the tokens; the
    greedy ones' line, over two k, can: the call is the draft's, whatever the request."""
    service, forward = ServiceAuto(AutoPolicy(), calibration()), calibration()

    def alone(greedy: bool, k: int) -> None:
        wait = 0.0030 + k * 0.0005
        service.observe(greedy, True, k, wait, forward[k + 1], wait + forward[k + 1] + 0.003)

    for _ in range(3):
        alone(False, 2)
    c, _, token = service.lone(greedy=False)
    assert c * token == pytest.approx(0.002)  # no line yet: all of the 4 ms wait is per token
    for _ in range(3):
        alone(True, 2), alone(True, 4)
    c, _, token = service.lone(greedy=False)
    assert c * token == pytest.approx(0.0005)


def test_the_drafts_cost_is_trusted_after_three_rounds():
    costs = ServedCosts({n: 0.01 for n in range(1, 18)})
    for _ in range(2):
        costs.observe(4, 0.004, 0.011, 0.016)
    assert costs.ratios() is None
    costs.observe(4, 0.004, 0.011, 0.016)
    assert costs.ratios() is not None


class ClockedModel:
    """A model whose forwards advance a fake clock: n positions cost cost_s[n], times 3
    while other processes load (the forwards in `busy`, a burst of contention)."""

    vocab_size = 100
    max_positions = 1024
    forwards = 0

    def __init__(self, cost_s: dict[int, float], busy: range) -> None:
        self.cost_s, self.busy, self.now, self.calls = cost_s, busy, 0.0, 0

    def clock(self) -> float:
        return self.now

    def new_cache(self, capacity: int) -> SimpleNamespace:
        return SimpleNamespace(length=0, rollback=lambda length: None)

    def forward(self, cache: SimpleNamespace, ids: list[int]) -> None:
        self.now += self.cost_s.get(len(ids), 0.001) * (3.0 if self.calls in self.busy else 1.0)
        self.calls += 1


def test_the_forward_calibration_keeps_its_shape_under_a_burst_of_contention(monkeypatch):
    # A CPU's sawtooth (5 positions cheaper than 4), which decides the best k.
    cost_s = {n: 0.006 * (1 + 0.3 * ((n - 1) % 4) + 0.05 * (n - 1)) for n in range(1, 18)}
    model = ClockedModel(cost_s, busy=range(20, 60))  # three of seven repetitions, in part
    monkeypatch.setattr(costs_module.time, "perf_counter", model.clock)
    measured = forward_seconds(model, range(1, 18))
    assert measured == pytest.approx(cost_s)


def run_session(service: ServiceAuto, session: AutoSession, accept: Callable[[int], int], rounds: int) -> list[Choice]:
    """Rounds as the decoder runs them: each proposal accepts accept(k) tokens."""
    choices = []
    for _ in range(rounds):
        choice = session.next()
        choices.append(choice)
        accepted = accept(choice.k) if choice.k else 0
        session.observe(choice.k, accepted, accepted + 1)
        if choice.k:
            service.observe_alpha(True, accepted, accepted < choice.k)
    return choices


def stretches(choices: list[Choice]) -> list[tuple[int, int]]:
    """(how, length) of each run of equal choices."""
    runs: list[tuple[int, int]] = []
    for choice in choices:
        if runs and runs[-1][0] == choice.how:
            runs[-1] = (choice.how, runs[-1][1] + 1)
        else:
            runs.append((choice.how, 1))
    return runs


def test_a_session_whose_draft_keeps_missing_goes_target_only_and_probes_with_growing_pauses():
    service = ServiceAuto(AutoPolicy(), calibration())
    costs_measured(service.greedy)
    choices = run_session(service, service.session(greedy=True), lambda k: 0, 600)
    runs = stretches(choices)
    assert runs[0][0] == BEST_K and runs[1][0] == LOW_GAIN
    assert runs[0][1] <= 10, f"the fall-back took {runs[0][1]} missed rounds"
    assert all(c.k == 0 and c.gain < PAUSE_BELOW for c in choices if c.how == LOW_GAIN)
    # Then target-only stretches of 32, 64, 128, 256 tokens, each ended by one probe.
    assert runs[1:9] == [(LOW_GAIN, 32), (PROBE, 1), (LOW_GAIN, 64), (PROBE, 1), (LOW_GAIN, 128), (PROBE, 1), (LOW_GAIN, 256), (PROBE, 1)]
    assert all(c.k == AutoPolicy().probe_k for c in choices if c.how == PROBE)


def test_a_gain_just_under_1_keeps_speculating_and_a_clear_loss_pauses():
    """Hysteresis: a pause costs a probe and restarts α̂, so a best gain within α̂'s noise
    of 1 keeps the session speculating; only one below pause_below pauses it."""
    c, v = 0.1, {k: 1.2 + 0.05 * k for k in range(1, 17)}

    def first_choice(alpha: float) -> Choice:
        return AutoSession(AutoPolicy(), lambda: (c, v), lambda: alpha).next()

    just_under = next(a / 1000 for a in range(1000) if 0.93 < best_k(a / 1000, c, v)[1] < 0.97)
    clear_loss = next(a / 1000 for a in range(1000) if 0.80 < best_k(a / 1000, c, v)[1] < 0.85)
    assert first_choice(just_under).how == BEST_K and first_choice(just_under).gain < 1
    assert first_choice(clear_loss).how == LOW_GAIN


def test_a_session_resumes_when_probes_hit():
    service = ServiceAuto(AutoPolicy(), calibration())
    costs_measured(service.greedy)
    session = service.session(greedy=True)
    missing = run_session(service, session, lambda k: 0, 30)
    assert missing[-1].how == LOW_GAIN
    # The text became predictable: every proposal is accepted whole from now on.
    hitting = run_session(service, session, lambda k: k, 60)
    first_probe = next(i for i, c in enumerate(hitting) if c.how == PROBE)
    assert hitting[first_probe + 1].how == BEST_K and hitting[-1].how == BEST_K and hitting[-1].k >= 8


def test_rounds_held_at_k_0_by_load_keep_the_sessions_acceptance_and_need_no_probe():
    """The batch chooser may run a session whose drafts are kept target-only for a while
    (AUTO_CHOICE_LOAD): those rounds are not evidence against the draft, so its α̂ stays
    and, when load falls, its next round speculates at once, not after a probe."""
    service = ServiceAuto(AutoPolicy(), calibration())
    costs_measured(service.greedy)
    session = service.session(greedy=True)
    hitting = run_session(service, session, lambda k: k - (k > 2), 20)
    assert hitting[-1].how == BEST_K
    alpha = session.alpha
    for _ in range(200):  # its own choice speculates, the batch holds it at k = 0
        assert session.next().how == BEST_K
        session.observe(0, 0, 1)
    assert session.alpha == pytest.approx(alpha)
    resumed = session.next()
    assert resumed.how == BEST_K and resumed.k > 0


def test_the_peers_schedules_give_k_by_requests_in_flight():
    mlc = AutoPolicy(schedule="table")  # the default table is MLC's
    assert [mlc.scheduled_k(n) for n in (1, 9, 10, 19, 20, 29, 30, 64)] == [4, 4, 3, 3, 2, 2, 0, 0]
    assert AutoPolicy(schedule="fixed").scheduled_k(64) == defaults.NUM_DRAFT_TOKENS
    assert AutoPolicy().scheduled_k(1) is None  # goodput: the costs decide
    assert parse_table(" 2:3, 8:1 ") == ((2, 3), (8, 1))
    for bad in ("", "4", "a:1", "8:1,4:2", "2:17"):
        with pytest.raises(ValueError):
            parse_table(bad)
    with pytest.raises(ValueError, match="goodput, table, fixed"):
        AutoPolicy(schedule="smart")


def test_before_the_drafts_cost_is_known_a_session_probes():
    service = ServiceAuto(AutoPolicy(), calibration())
    first = service.session(greedy=True).next()
    assert first.how == PROBE and first.k == AutoPolicy().probe_k
    # Sampled requests' costs stand in for greedy ones until those are measured, and back.
    costs_measured(service.sampled, draft_per_token_s=0.002)
    assert service.ratios(greedy=True) == service.ratios(greedy=False) is not None
    assert service.session(greedy=True).next().how == BEST_K
    costs_measured(service.greedy)
    assert service.ratios(greedy=True)[0] < service.ratios(greedy=False)[0]


def test_a_sessions_own_gain_comes_from_rounds_that_ran_alone():
    """Rounds served in a batch carry the batch's forward and proposals: they stand in only
    until some session ran alone, so load does not read as a draft that stopped paying."""
    service = ServiceAuto(AutoPolicy(), calibration())
    for _ in range(3):  # batched rounds: the draft proposes for 16 sessions while the target-only ones wait less
        service.observe(True, False, 4, 0.200, 0.050, 0.260)
        service.observe(True, False, 0, 0.0, 0.045, 0.050)
    loaded = service.ratios(greedy=True)
    assert loaded is not None and best_k(0.8, *loaded)[1] < PAUSE_BELOW
    for _ in range(3):  # alone: the forward as calibrated, 1 ms a draft token
        verify_5 = calibration()[5]
        service.observe(True, True, 4, 0.004, verify_5, 0.004 + verify_5 + 0.003)
    alone = service.ratios(greedy=True)
    assert best_k(0.8, *alone)[1] > 1.5
    for _ in range(50):  # more load changes nothing alone
        service.observe(True, False, 4, 0.200, 0.050, 0.260)
    assert service.ratios(greedy=True) == alone


def test_whether_a_request_opens_its_draft_is_priced_from_what_opening_costs_as_served():
    """(N − 1)·T0·(1 − 1/g) saved against the draft's prefill and first round's extra wait."""
    service = ServiceAuto(AutoPolicy(), calibration())
    assert service.opening(2, greedy=True).pays  # nothing measured yet: open, to measure
    assert not service.opening(1, greedy=True).pays  # one token: one target-only round, whatever the costs
    costs_measured(service.greedy)
    for _ in range(100):
        service.observe_alpha(True, 4, False)  # the draft hits greedy: the service's greedy α̂ is 1
    for _ in range(3):
        service.observe_opening(0.040)
        service.observe_first_round(4, 4 * 0.001 + 0.010, greedy=True)  # 10 ms beyond a steady round's wait
    token = 0.007 + 0.002
    _, g = best_k(1.0, *service.ratios(greedy=True), AutoPolicy().k_max)
    pays_from = 1 + 0.050 / (token * (1 - 1 / g))  # the first N whose saving passes 50 ms
    below, above = int(pays_from), int(pays_from) + 1
    assert not service.opening(below, greedy=True).pays and service.opening(above, greedy=True).pays
    assert "50.0 ms to open" in service.opening(below, greedy=True).detail
    # A cheaper prefill, measured, opens drafts for shorter requests.
    for _ in range(10):
        service.observe_opening(0.001)
    assert service.opening(below, greedy=True).pays
    # Where no k gains at the service's α̂, one request in eight opens, its own rounds (a
    # pause after a probe) measuring α̂ again: declining all would keep it from recovering.
    for _ in range(2000):
        service.observe_alpha(True, 0, True)
    openings = [service.opening(64, greedy=True) for _ in range(16)]
    assert [o.pays for o in openings] == [True, *[False] * 7] * 2
    assert {o.reason for o in openings if not o.pays} == {common_pb2.TARGET_ONLY_REASON_AUTO_NOT_OPENED}


def test_under_load_a_request_opens_its_draft_only_where_the_batch_gains():
    """Alone the draft pays; with 16 requests the forward is compute-bound (each row costs
    as much as a session's token), so no k gains at any α̂: one request in eight opens a
    draft (its rounds measure α̂), the others run target-only without one."""
    service = ServiceAuto(AutoPolicy(), calibration())
    batch = {(1, 1): 0.007, (1, 4): 0.0075, (1, 16): 0.009, (16, 1): 0.032, (16, 4): 0.128, (16, 16): 0.512}
    service.calibrate(calibration(), batch)
    costs_measured(service.greedy)
    for steps in (2, 4, 3):
        service.step_costs.observe_draft(steps, steps, 1e-3 * steps)
    for _ in range(100):
        service.observe_alpha(True, 4, False)
    for _ in range(3):
        service.observe_opening(0.002)
    assert all(service.opening(64, greedy=True, in_service=n).pays for n in (1, 2, 1, 2))
    loaded = [service.opening(64, greedy=True, in_service=16) for _ in range(9)]
    assert [o.pays for o in loaded] == [True, *[False] * 7, True]
    assert loaded[1].reason == common_pb2.TARGET_ONLY_REASON_AUTO_NOT_OPENED
    assert "with 16 requests in service" in loaded[1].detail
    # No sampled session speculated yet: its kind's α̂ is the policy's guess, and every one opens.
    sampled = [service.opening(64, greedy=False, in_service=16) for _ in range(9)]
    assert all(o.pays and "not measured yet" in o.detail for o in sampled)


def test_the_services_prior_is_kept_apart_for_greedy_and_sampled_sessions():
    """The same draft keeps far fewer tokens sampled than greedy: greedy rounds that hit must
    not open a sampled request's draft or start its session from their α̂."""
    service = ServiceAuto(AutoPolicy(), calibration())
    costs_measured(service.greedy)
    costs_measured(service.sampled)
    for _ in range(3):
        service.observe_opening(0.040)
    for _ in range(200):
        service.observe_alpha(True, 4, False)  # greedy: every proposal kept
        service.observe_alpha(False, 0, True)  # sampled: none
    assert service.prior_alpha(greedy=True) == pytest.approx(1.0)
    assert service.prior_alpha(greedy=False) == pytest.approx(0.0)
    assert service.session(greedy=True).alpha > 0.9 and service.session(greedy=False).alpha < 0.1
    assert service.opening(64, greedy=True).pays and "α̂ 1.00" in service.opening(64, greedy=True).detail
    assert "α̂ 0.00" in service.opening(64, greedy=False).detail


# --- through the services ------------------------------------------------------------------


def test_short_requests_never_contact_the_draft(far_stack):
    before = draft_info(far_stack)
    completion = run(far_stack, auto_request(1))
    after = draft_info(far_stack)
    assert len(completion.token_ids) == 1
    assert (after.forwards, after.proposals) == (before.forwards, before.proposals)
    [m] = completion.messages
    assert m.round.mode == common_pb2.SPECULATION_MODE_AUTO
    assert m.round.auto_choice == common_pb2.AUTO_CHOICE_SHORT_OUTPUT and m.round.draft_tokens == 0
    assert m.speculation.reason == common_pb2.TARGET_ONLY_REASON_AUTO_SHORT_OUTPUT


def test_32_token_greedy_requests_on_the_embedded_pair_speculate(default_pair_stack):
    """A fixed cut-off at 32 tokens ran these target-only; the opening's measured cost is a
    small part of what 31 speculative tokens save on this pair."""
    prompt = defaults.heldout_prompts_by_file()["py_compile.py"]
    for _ in range(4):  # the opening's cost is measured over the first sessions
        warm = run(default_pair_stack, auto_request(32, text=prompt), timeout=120)
    assert warm.usage.draft_tokens_proposed > 0
    assert warm.messages[0].speculation.speculating


def test_every_auto_round_says_what_it_chose_and_the_output_stays_exact(far_stack):
    # This toy draft is mostly wrong and costs about a target step, so AUTO mostly judges
    # that speculation does not pay; whatever it chose, each round must say so consistently.
    reference = run(far_stack, request(PROMPT, max_new_tokens=120, speculation=False))
    completion = run(far_stack, auto_request(120))
    assert completion.token_ids == reference.token_ids
    for m in completion.messages[:-1]:
        r = m.round
        assert r.mode == common_pb2.SPECULATION_MODE_AUTO and 0 <= r.alpha_estimate <= 1
        if r.auto_choice == BEST_K:
            assert 1 <= r.draft_tokens <= 16 and r.expected_gain >= PAUSE_BELOW and m.speculation.speculating
        elif r.auto_choice == LOW_GAIN:
            assert r.draft_tokens == 0 and r.expected_gain < PAUSE_BELOW and not m.speculation.speculating
        else:
            assert r.auto_choice == PROBE and 1 <= r.draft_tokens <= AutoPolicy().probe_k


def test_auto_on_the_default_pair_speculates_and_stays_exact(default_pair_stack):
    stack = default_pair_stack
    # A held-out prompt the committed draft follows (greedy acceptance 0.98 over 200 tokens at
    # k = 4, an expected gain near 2.5 with the costs measured here, c 0.12 and v(4) 1.45):
    # where α̂ is near 0.6 the gain is near 1, and whether AUTO speculates there rightly turns
    # on the machine's measured costs.
    prompt = defaults.heldout_prompts_by_file()["py_compile.py"]
    reference = run(stack, request(prompt, max_new_tokens=200, speculation=False), timeout=120)
    auto = [run(stack, auto_request(200, text=prompt), timeout=120) for _ in range(2)]
    assert all(completion.token_ids == reference.token_ids for completion in auto)
    # (The last round of an output is cut to k = 0 when one token is left, whatever the choice.)
    chosen = [m.round for c in auto for m in c.messages[:-1] if m.round.auto_choice == BEST_K]
    # On this pair greedy speculation pays where the draft keeps up (the benchmark measures
    # how much): AUTO speculates, each k chosen with an expected gain.
    assert chosen and all(r.expected_gain >= PAUSE_BELOW and 1 <= r.draft_tokens <= 16 for r in chosen)


def test_a_draft_that_keeps_missing_falls_back_to_target_only_and_stays_exact(far_stack):
    n = 240
    reference = run(far_stack, request(PROMPT, max_new_tokens=n, speculation=False))
    fixed = run(far_stack, request(PROMPT, max_new_tokens=n, k=4))
    completion = run(far_stack, auto_request(n))
    assert completion.token_ids == reference.token_ids == fixed.token_ids
    rounds = [m.round for m in completion.messages]
    low = [m for m in completion.messages if m.round.auto_choice == LOW_GAIN]
    assert low and all(m.speculation.reason == common_pb2.TARGET_ONLY_REASON_AUTO_LOW_GAIN for m in low)
    assert all(m.round.draft_tokens == 0 and m.round.expected_gain < PAUSE_BELOW for m in low)
    assert sum(r.auto_choice == PROBE for r in rounds) >= 2  # it probes again later
    assert completion.usage.draft_tokens_proposed < fixed.usage.draft_tokens_proposed / 4


def test_sixteen_streams_of_a_draft_that_keeps_missing_run_target_only_but_for_probes(far_stack):
    n = 96
    references = [run(far_stack, request(p, max_new_tokens=n, speculation=False)).token_ids for p in STREAMS]
    with ThreadPoolExecutor(len(STREAMS)) as pool:
        together = list(pool.map(lambda p: run(far_stack, auto_request(n, text=p)), STREAMS))
    assert [c.token_ids for c in together] == references
    rounds = [m.round for c in together for m in c.messages]
    assert max(r.batch_sessions for r in rounds) >= 8  # they ran as a batch
    # A session speculates while its α̂ is still the service's prior (its first rounds), to
    # probe after a pause, and briefly after a probe that happened to hit; the rest of its
    # rounds are target-only.
    steady = [r for c in together for m in c.messages[4:] if (r := m.round).draft_tokens]
    assert sum(r.auto_choice != PROBE for r in steady) <= 0.05 * len(rounds)
    assert sum(r.draft_tokens == 0 for r in rounds) > 0.8 * len(rounds)
    # The verify service's recent requests show the load they ran under.
    bands = {(b.min_sessions, b.max_sessions): b for b in verify_info(far_stack, recent=16).recent.load_bands}
    assert bands[(5, 16)].auto_rounds > 0 and bands[(5, 16)].alpha_hat < 0.3


def test_a_session_held_at_k_0_by_load_resumes_speculating_without_a_probe_when_the_others_finish(stack_factory):
    """A draft that is cheap alone and dear in company (tests/crowded_draft.py): in company
    the chooser holds the sessions at k = 0 (LOAD, α̂ kept); the one left when the others
    finish speculates again at once, with no probe, and its output stays exact."""
    pair = Path(defaults.DEFAULT_TARGET), Path(defaults.DEFAULT_DRAFT)
    crowded = {"draft": [sys.executable, "tests/crowded_draft.py"]}
    patient = {"verify": ["--threads", "2", "--draft-deadline-min-ms", "10000", "--max-sessions", "8"]}
    stack = stack_factory(*pair, args=patient, programs=crowded)
    prompt = defaults.heldout_prompts_by_file()["py_compile.py"]
    for _ in range(3):  # alone: the session's own costs and the draft's line are measured
        run(stack, auto_request(48, text=prompt), timeout=120)
    reference = run(stack, request(prompt, max_new_tokens=160, speculation=False), timeout=120)
    with ThreadPoolExecutor(6) as pool:
        calls = [pool.submit(run, stack, auto_request(160 if i == 0 else 48, text=prompt), 120) for i in range(6)]
        long = calls[0].result()
    assert long.token_ids == reference.token_ids
    rounds = [m.round for m in long.messages[:-1]]
    held = [i for i, r in enumerate(rounds) if r.auto_choice == LOAD]
    assert held, [(r.auto_choice, r.draft_tokens, r.batch_sessions, round(r.predicted_tokens_per_s), r.draft_time_us // 1000, r.verify_time_us // 1000) for r in rounds]
    assert all(rounds[i].batch_sessions > 1 and rounds[i].draft_tokens == 0 for i in held)
    # Held rounds are not evidence against the draft: α̂ stays as it was.
    assert all(rounds[i].alpha_estimate == rounds[i - 1].alpha_estimate for i in held if i - 1 in held)
    after = rounds[held[-1] + 1 :]
    alone = [r for r in after if r.batch_sessions == 1]
    assert alone and alone[0].auto_choice == BEST_K and alone[0].draft_tokens > 0
    assert PROBE not in {r.auto_choice for r in after}


@pytest.mark.parametrize("in_flight", [1, 16])
def test_seeded_sampled_auto_requests_equal_their_target_only_output_at_any_load(shared_stack, in_flight):
    """The shared-noise coupling holds while AUTO changes k from round to round and the
    batch chooser from step to step, beside requests that fix their own k (under load AUTO
    may open no draft for this toy pair, and the fixed ones keep the batch speculating)."""

    def sampled(i: int, mode: common_pb2.SpeculationMode):
        req = request(STREAMS[i], max_new_tokens=48, temperature=0.8, top_p=0.95, seed=500 + i)
        req.speculation.mode = mode
        if mode == common_pb2.SPECULATION_MODE_ON:
            req.speculation.num_draft_tokens = 2 + i % 5
        return req

    def mode(i: int) -> common_pb2.SpeculationMode:
        return common_pb2.SPECULATION_MODE_ON if i % 2 else common_pb2.SPECULATION_MODE_AUTO

    references = [run(shared_stack, sampled(i, common_pb2.SPECULATION_MODE_OFF)).token_ids for i in range(in_flight)]
    with ThreadPoolExecutor(in_flight) as pool:
        served = list(pool.map(lambda i: run(shared_stack, sampled(i, mode(i))), range(in_flight)))
    assert [c.token_ids for c in served] == references
    ks = {m.round.draft_tokens for c in served for m in c.messages[:-1]}
    assert len(ks) > 1  # k moved between rounds
    assert max(m.round.batch_sessions for c in served for m in c.messages) >= min(in_flight, 8)


def test_the_default_mode_is_auto_and_a_fixed_k_means_on(far_stack):
    unset = request(PROMPT, max_new_tokens=40)
    unset.ClearField("speculation")
    assert run(far_stack, unset).messages[0].round.mode == common_pb2.SPECULATION_MODE_AUTO
    fixed = request(PROMPT, max_new_tokens=40, k=3)
    fixed.speculation.mode = common_pb2.SPECULATION_MODE_UNSPECIFIED
    rounds = [m.round for m in run(far_stack, fixed).messages]
    assert rounds[0].mode == common_pb2.SPECULATION_MODE_ON and rounds[0].draft_tokens == 3
    both = auto_request(40)
    both.speculation.num_draft_tokens = 3
    err = rpc_error(far_stack, both)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_draft_tokens" in err.details()


@pytest.fixture(scope="module")
def flagged_stack(stack_factory, toy):
    """ON by default, and AUTO by a table: alone k = 3, else target-only."""
    flags = ["--speculation", "on", "--speculation-policy", "table", "--speculation-table", "2:3"]
    return stack_factory(toy.target, toy.same, args={"verify": flags})


def test_the_servers_default_mode_is_a_flag(flagged_stack):
    unset = request(PROMPT, max_new_tokens=20)
    unset.ClearField("speculation")
    assert all(m.round.mode == common_pb2.SPECULATION_MODE_ON for m in run(flagged_stack, unset).messages)


def test_the_table_policy_sets_k_by_requests_in_flight_and_an_explicit_k_still_wins(flagged_stack):
    stack = flagged_stack
    reference = run(stack, request(PROMPT, max_new_tokens=40, speculation=False))
    alone = run(stack, auto_request(40))
    assert alone.token_ids == reference.token_ids
    assert all(m.round.auto_choice == SCHEDULE and m.round.draft_tokens == 3 for m in alone.messages[:-1])
    held = HeldDecode(stack, list(range(5, 25)), 200)  # a second request in flight, its reader stalled
    try:
        busy = run(stack, auto_request(40))
        assert busy.token_ids == reference.token_ids
        assert all(m.round.auto_choice == SCHEDULE and m.round.draft_tokens == 0 for m in busy.messages)
        fixed = run(stack, request(PROMPT, max_new_tokens=40, k=2))  # a request's own k is not AUTO's
        assert fixed.token_ids == reference.token_ids and fixed.messages[0].round.draft_tokens == 2
    finally:
        held.cancel()
