"""AUTO speculation: the number of draft tokens of each round of a session.

The gain of k draft tokens is docs/design.md's E(k) / (k·c + v(k)) (specdec.speculation_gain),
with every cost measured as this service serves it, in units of one target-only token:
  T0    = a target-only round: the target's forward and acceptance over 1 position plus
          the rest of that round (RPC, Python, sending the token)
  c     = what each proposed token adds to the draft's wait / T0
  v(k)  = (the target's forward and acceptance over k+1 positions + the rest of a
          speculative round + the draft's wait for a proposal of any k) / T0
so a gain above 1 is an expected speedup over this service's own target-only rounds.
These are a session's costs alone, from rounds that ran alone: a round served in a batch
carries the batch's forward and proposals, so a draft that pays would look like a loss
under load, where the batch chooser sets k (verify_service/rounds.py). Until some session
ran alone, every round's costs stand in.
A forward over n positions costs its calibration at startup times how much slower served
rounds ran than theirs (acceptance, a longer context, the other processes), a ratio taken
apart for speculative and target-only rounds; those ratios and the rest are medians over
recent rounds, measured apart for greedy and for sampled requests, whose acceptance costs
more.

A session's α̂ is accepted / (accepted + rejections) over its rounds, older rounds
decaying, with the service's running α̂ (every session's recent rounds, this one's too)
as a prior worth prior_weight positions. While no k is expected to gain (the best gain is
below pause_below, a margin under 1 for α̂'s noise), the session runs target-only; after
a stretch it probes with one speculative round, its α̂ starting again from the service's.
Each stretch is twice the one before, unless the session speculated for STEADY_ROUNDS
rounds in between.

Whether a request opens a draft session at all is priced the same way (`ServiceAuto.opening`):
its max_new_tokens N at the gain g expected at the service's α̂ save (N − 1)·T0·(1 − 1/g)
seconds (its last round is target-only: nothing is left to propose past it),
against what opening costs as served: the draft's prefill (the seconds the draft reports)
and its first round's wait beyond a steady round's. A request whose saving is smaller runs
target-only and never contacts the draft. With other requests in service, g and T0 are the
batch's at that load; while no k gains, one request in measure_every opens, to measure α̂.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from specdec.batch_gain import choose_ks, goodput
from specdec.defaults import NUM_DRAFT_TOKENS
from specdec.speculation_gain import best_k
from specdec.v1 import common_pb2
from verify_service.step_costs import ContextCost, ServedStepCosts

WINDOW = 32  # recent rounds whose median gives each measured cost
MIN_DRAFT_SAMPLES = 3  # rounds measured before the draft's cost is trusted
MIN_OPEN_SAMPLES = 3  # draft sessions opened before the opening's cost is trusted
STEADY_ROUNDS = 8  # speculative rounds in a row after which a pause starts short again


SCHEDULES = ("goodput", "table", "fixed")
# MLC-LLM's schedule: below 10 requests in flight k = 4, below 20 k = 3, below 30 k = 2,
# from 30 on target-only.
MLC_TABLE: tuple[tuple[int, int], ...] = ((10, 4), (20, 3), (30, 2))


def parse_table(text: str) -> tuple[tuple[int, int], ...]:
    """"10:4,20:3,30:2" -> ((10, 4), (20, 3), (30, 2)): below 10 requests in flight k = 4,
    ...; from the last bound on, target-only. Bounds must rise; k must be 0..16."""
    table: list[tuple[int, int]] = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        bound, sep, k = entry.partition(":")
        if not sep or not bound.strip().isdigit() or not k.strip().isdigit():
            raise ValueError(f"{entry!r} is not BOUND:K (e.g. 10:4)")
        table.append((int(bound), int(k)))
    if not table:
        raise ValueError("the table is empty")
    if any(b2 <= b1 for (b1, _), (b2, _) in zip(table, table[1:])):
        raise ValueError(f"bounds must rise: {text!r}")
    if any(not 0 <= k <= 16 for _, k in table):
        raise ValueError(f"each k must be 0..16: {text!r}")
    return tuple(table)


@dataclass(frozen=True)
class AutoPolicy:
    k_max: int = 16
    probe_k: int = 2  # k of a probe round (and of rounds before the draft's cost is known)
    first_pause_tokens: int = 32  # target-only tokens before the first probe
    max_pause_tokens: int = 256
    # While no k gains when a request arrives, one request of its kind in this many opens a
    # draft anyway, its probes measuring the service's α̂ again; the others run target-only
    # without one (each opening costs a draft prefill and probes beside the target).
    measure_every: int = 8
    decay: float = 0.95  # per round, of a session's acceptance counts
    prior_alpha: float = 0.6  # the service's α̂ before any round
    prior_weight: float = 8.0  # the service's α̂'s worth, in positions, in a session's
    # A session pauses when the best expected gain falls below this, not below 1: a gain
    # just under 1 is within a session's α̂ noise (a few misses), while a pause costs a
    # probe and restarts α̂ from the service's, so pausing there loses where k pays.
    pause_below: float = 0.9
    # How AUTO chooses k: goodput (each step, from the batch's costs and each session's
    # α̂), or a peer's schedule for comparison on this engine: table (k by the requests in
    # flight, from `table`) or fixed (`fixed_k`, ON's k, whatever the load).
    schedule: str = "goodput"
    table: tuple[tuple[int, int], ...] = MLC_TABLE
    fixed_k: int = NUM_DRAFT_TOKENS

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: must be one of {', '.join(SCHEDULES)}, not {self.schedule!r}")

    def scheduled_k(self, in_flight: int) -> int | None:
        """The table or fixed schedule's k with `in_flight` requests decoding; None under goodput."""
        if self.schedule == "fixed":
            return self.fixed_k
        if self.schedule == "table":
            return next((k for bound, k in self.table if in_flight < bound), 0)
        return None


@dataclass(frozen=True)
class Opening:
    """Whether an AUTO request opens a draft session, and why."""

    pays: bool
    detail: str  # the figures the decision took, as a sentence
    # Why it does not open: the output is too short for the saving to pay the opening,
    # or no k gains now and it is not the one request in measure_every that measures α̂.
    reason: int = common_pb2.TARGET_ONLY_REASON_AUTO_SHORT_OUTPUT


@dataclass(frozen=True)
class Choice:
    """What the next round does under AUTO."""

    k: int
    how: common_pb2.AutoChoice
    gain: float  # the session's own best expected gain, as if alone; 0 if not computed
    alpha: float  # the α̂ the choice used
    predicted_tokens_per_s: float = 0.0  # the step's, when the batch chooser chose k


class _Window:
    """The median of the last WINDOW samples: a proposal's wait swings from nothing (asked
    for early, it was ready) to several steps, and one outlier must not steer k."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=WINDOW)

    def add(self, sample: float) -> None:
        self._samples.append(sample)

    def __len__(self) -> int:
        return len(self._samples)

    def median(self, default: float) -> float:
        return statistics.median(self._samples) if self._samples else default


class ServedCosts:
    """One kind of request's (greedy or sampled) running costs. Thread-safe."""

    def __init__(self, forward_s: dict[int, float]) -> None:
        self._lock = threading.Lock()
        self._forward = dict(forward_s)  # positions -> calibrated seconds of a forward
        self._spec_scale = _Window()  # a speculative round's forward and acceptance / its calibration
        self._solo_scale = _Window()  # the same for a target-only round
        self._draft: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (k, a round's wait for its proposal)
        self._spec_rest = _Window()  # a speculative round's time beyond the wait, forward and acceptance
        self._solo_rest = _Window()  # the same for a target-only round
        self._fitted: tuple[float, float] | None = None  # the fitted line, kept until the next round
        self._fitted_stale = True

    def observe(self, k: int, draft_wait_s: float, verify_s: float, period_s: float) -> None:
        """One steady round (not a session's first, nor a probe after a target-only stretch,
        whose draft catches up on the tokens it missed): k draft tokens (0: target-only),
        its wait for the proposal, its forward and acceptance, and its period (from its
        start to the next round's)."""
        rest = max(0.0, period_s - draft_wait_s - verify_s)
        with self._lock:
            if k + 1 not in self._forward:
                return
            if k:
                self._spec_scale.add(verify_s / self._forward[k + 1])
                self._draft.append((k, draft_wait_s))
                self._fitted_stale = True
                self._spec_rest.add(rest)
            else:
                self._solo_scale.add(verify_s / self._forward[1])
                self._solo_rest.add(rest)

    def ratios(self, call_hint: float | None = None) -> tuple[float, dict[int, float]] | None:
        """(c, {k: v(k)}) in target-only tokens, or None while the draft's cost is unknown.
        The proposal's fixed part (the call) is paid once a round whatever its k: it goes
        into v(k), and c is what each further draft token adds. call_hint: the call as
        another line measured it, for when these rounds ran at one k only."""
        with self._lock:
            line = self._draft_line(call_hint)
            if line is None:
                return None
            call, per_token = line
            spec_scale, spec_rest = self._spec_scale.median(1.0), self._spec_rest.median(0.0)
            token = self._token_seconds()
            fixed = spec_rest + call
            v = {n - 1: (seconds * spec_scale + fixed) / token for n, seconds in self._forward.items() if n > 1}
        return per_token / token, v

    def measured(self) -> bool:
        """Whether the draft's cost is measured (`ratios` then answers)."""
        with self._lock:
            return len(self._draft) >= MIN_DRAFT_SAMPLES

    def proposal_seconds(self, k: int, call_hint: float | None = None) -> float | None:
        """A steady round's expected wait for k draft tokens, once measured."""
        with self._lock:
            line = self._draft_line(call_hint)
        return None if line is None else line[0] + line[1] * k

    def draft_call(self) -> float | None:
        """The proposal's call in seconds, where these rounds tell it apart (two k or more)."""
        with self._lock:
            fitted = self._fitted_line()
        return None if fitted is None else fitted[0]

    def _draft_line(self, call_hint: float | None) -> tuple[float, float] | None:
        """(seconds per proposal, per draft token): the fitted line; else, with rounds at
        one k only, the hinted call and the median of what each wait adds to it per token
        (all per token without a hint). A wait is mostly the call (RPC, the draft's
        Python), not its forwards: priced per token, a large k would look dear."""
        if len(self._draft) < MIN_DRAFT_SAMPLES:
            return None
        fitted = self._fitted_line()
        if fitted is not None:
            return fitted
        call = call_hint or 0.0
        return call, statistics.median(max(0.0, wait - call) / k for k, wait in self._draft)

    def _fitted_line(self) -> tuple[float, float] | None:
        """A line through each k's median wait, by least squares, where rounds ran at two
        k or more and neither part fits negative. Kept until the next round: every
        session's every round asks for it."""
        if self._fitted_stale:
            self._fitted, self._fitted_stale = self._fit_line(), False
        return self._fitted

    def _fit_line(self) -> tuple[float, float] | None:
        by_k: dict[int, list[float]] = {}
        for k, wait in self._draft:
            by_k.setdefault(k, []).append(wait)
        if len(by_k) < 2:
            return None
        ks = np.array(sorted(by_k), dtype=float)
        waits = np.array([statistics.median(by_k[k]) for k in sorted(by_k)])
        (call, per_token), *_ = np.linalg.lstsq(np.stack([np.ones_like(ks), ks], axis=1), waits, rcond=None)
        return (float(call), float(per_token)) if call >= 0 and per_token >= 0 else None

    def token_seconds(self) -> float:
        """T0: the seconds of a target-only round as served."""
        with self._lock:
            return self._token_seconds()

    def _token_seconds(self) -> float:
        # Until a target-only round is measured, assume it runs like a speculative one.
        spec_scale, spec_rest = self._spec_scale.median(1.0), self._spec_rest.median(0.0)
        return self._forward.get(1, 0.0) * self._solo_scale.median(spec_scale) + self._solo_rest.median(spec_rest)


class ServiceAuto:
    """The service's side of AUTO: the policy, the running costs and the α̂ prior."""

    def __init__(self, policy: AutoPolicy, forward_s: dict[int, float] | None = None) -> None:
        """forward_s: the target's calibrated forward seconds by positions (or later, by
        `calibrate`, before the first request)."""
        self.policy = policy
        self.step_costs: ServedStepCosts | None = None  # a batched step's, once calibrated
        self.calibrate(forward_s or {})
        self._lock = threading.Lock()
        # The α̂ prior by kind (greedy or sampled): the same draft keeps far fewer tokens
        # sampled than greedy, and a greedy prior would open and speculate sampled requests.
        self._accepted = {True: 0.0, False: 0.0}
        self._rejected = {True: 0.0, False: 0.0}
        self._draft_prefill = _Window()  # seconds of a draft session's prefill, as the draft reports
        self._first_wait = _Window()  # a first round's wait for its proposal beyond a steady round's
        self._unopened = {True: 0, False: 0}  # requests by kind that arrived while no k gained

    def calibrate(
        self,
        forward_s: dict[int, float],
        batch_forward_s: Mapping[tuple[int, int], float] | None = None,
        context: ContextCost | None = None,
    ) -> None:
        """forward_s: one session's forward seconds by positions; batch_forward_s: a
        forward's seconds by (sessions, positions each), for the batch chooser, and context
        what a longer context adds to them."""
        self.greedy = ServedCosts(forward_s)  # rounds that ran alone in their step
        self.sampled = ServedCosts(forward_s)
        self._every_round = {True: ServedCosts(forward_s), False: ServedCosts(forward_s)}  # alone or not
        if batch_forward_s:
            self.step_costs = ServedStepCosts(batch_forward_s, context)

    def costs(self, greedy: bool) -> ServedCosts:
        return self.greedy if greedy else self.sampled

    def observe_alpha(self, greedy: bool, accepted: int, rejected: bool) -> None:
        """A speculative round of any greedy or sampled session (the prior follows about
        the last 100 of its kind)."""
        with self._lock:
            self._accepted[greedy] = 0.99 * self._accepted[greedy] + accepted
            self._rejected[greedy] = 0.99 * self._rejected[greedy] + rejected

    def alpha_measured(self, greedy: bool) -> bool:
        """Whether a speculative round of a greedy or sampled session ran yet."""
        with self._lock:
            return self._accepted[greedy] + self._rejected[greedy] > 0

    def prior_alpha(self, greedy: bool) -> float:
        """The service's α̂ for a greedy or sampled session; the policy's until one ran."""
        with self._lock:
            seen = self._accepted[greedy] + self._rejected[greedy]
            return self._accepted[greedy] / seen if seen else self.policy.prior_alpha

    def ratios(self, greedy: bool) -> tuple[float, dict[int, float]] | None:
        """c and v(k) of a greedy or sampled session alone: what decides whether its draft
        is worth speculating with at all (under load, the batch chooser sets its k)."""
        lone = self.lone(greedy)
        return None if lone is None else lone[:2]

    def observe(self, greedy: bool, alone: bool, k: int, draft_wait_s: float, verify_s: float, period_s: float) -> None:
        """A steady round (ServedCosts.observe) of a greedy or sampled session; `alone`: the
        only round of its step."""
        self._every_round[greedy].observe(k, draft_wait_s, verify_s, period_s)
        if alone:
            self.costs(greedy).observe(k, draft_wait_s, verify_s, period_s)

    def lone(self, greedy: bool) -> tuple[float, dict[int, float], float] | None:
        """(c, v(k), T0 in seconds) of a greedy or sampled session alone."""
        costs = self._lone_costs(greedy)
        return None if costs is None else (*costs.ratios(self._draft_call()), costs.token_seconds())

    def _draft_call(self) -> float | None:
        """The draft's call as the first line that tells it measured it: rounds alone, then
        every round, then the batched steps' fit. The call is the draft's, whatever the
        request: sampled sessions that probe at one k learn it from greedy ones."""
        for costs in (self.greedy, self.sampled, *self._every_round.values()):
            call = costs.draft_call()
            if call is not None:
                return call
        line = None if self.step_costs is None else self.step_costs.draft_line()
        return line[0] if line is not None and line[0] > 0 else None

    def _lone_costs(self, greedy: bool) -> ServedCosts | None:
        """A session's costs alone: its kind's rounds that ran alone, else the other kind's
        (a better first guess than none), else, until some session ran alone, every round's."""
        kinds = (greedy, not greedy)
        for costs in [self.costs(kind) for kind in kinds] + [self._every_round[kind] for kind in kinds]:
            if costs.measured():
                return costs
        return None

    def observe_opening(self, prefill_s: float) -> None:
        """A draft session opened: the draft's prefill took `prefill_s`."""
        with self._lock:
            self._draft_prefill.add(prefill_s)

    def observe_first_round(self, k: int, draft_wait_s: float, greedy: bool) -> None:
        """A session's first speculative round waited `draft_wait_s` for its k tokens."""
        costs = self._lone_costs(greedy)
        steady = None if costs is None else costs.proposal_seconds(k, self._draft_call())
        if steady is not None:
            with self._lock:
                self._first_wait.add(max(0.0, draft_wait_s - steady))

    def opening(self, max_new_tokens: int, greedy: bool, in_service: int = 1) -> Opening:
        """Whether a request of max_new_tokens opens a draft session: the saving expected
        over its output at the service's α̂ against the opening's measured cost, with
        `in_service` requests in the service (this one too). Under load the gain is the
        batch's: a step of that many sessions at the service's α̂ (batch chooser) against
        the same step target-only. Until the costs and the service's α̂ of its kind are
        measured it opens. While no k is expected to gain, one request of its kind in
        policy.measure_every opens: only sessions that speculate tell the service's α̂ that
        the draft recovered (their own pause bounds the loss)."""
        if max_new_tokens <= 1:
            return Opening(False, "one token is one target-only round: there is nothing to propose")
        lone = self.lone(greedy)
        with self._lock:
            measured = len(self._draft_prefill) >= MIN_OPEN_SAMPLES
            cost = self._draft_prefill.median(0.0) + self._first_wait.median(0.0)
        if lone is None or not measured:
            return Opening(True, "the opening's cost is not measured yet")
        if not self.alpha_measured(greedy):
            return Opening(True, f"the service's α̂ of {'greedy' if greedy else 'sampled'} requests is not measured yet")
        c, v, token_s = lone
        alpha = self.prior_alpha(greedy)
        _, gain = best_k(alpha, c, v, self.policy.k_max)
        load = ""
        if in_service > 1 and gain > 1.0 and (loaded := self._loaded_gain(alpha, in_service)) is not None:
            gain, token_s = loaded
            load = f" with {in_service} requests in service"
        if gain <= 1.0:
            with self._lock:
                measures = self._unopened[greedy] % self.policy.measure_every == 0
                self._unopened[greedy] += 1
            every = f"one request in {self.policy.measure_every} opens a draft to measure it"
            if measures:
                return Opening(True, f"no k gains at the service's α̂ {alpha:.2f}{load}, and {every}: this one")
            reason = common_pb2.TARGET_ONLY_REASON_AUTO_NOT_OPENED
            return Opening(False, f"no k gains at the service's α̂ {alpha:.2f}{load}, and {every}", reason)
        saving = (max_new_tokens - 1) * token_s * (1.0 - 1.0 / gain)
        sentence = (
            f"{max_new_tokens} tokens at {gain:.2f}x (α̂ {alpha:.2f}{load}) would save {saving * 1e3:.1f} ms "
            f"against {cost * 1e3:.1f} ms to open the draft (its prefill and first round)"
        )
        return Opening(saving > cost, sentence)

    def _loaded_gain(self, alpha: float, sessions: int) -> tuple[float, float] | None:
        """(the gain, a target-only step's seconds) of a step of `sessions` sessions, every one
        at α̂ `alpha`, k chosen by the batch chooser; None until the step's costs are known."""
        step = None if self.step_costs is None else self.step_costs.step_costs(sessions, self.policy.k_max)
        if step is None:
            return None
        alphas = [alpha] * sessions
        _, speculating = choose_ks(alphas, step, self.policy.k_max)
        target_only = goodput(alphas, [0] * sessions, step)
        return speculating / target_only, step.step([0] * sessions)

    def session(self, greedy: bool) -> AutoSession:
        return AutoSession(self.policy, lambda: self.ratios(greedy), lambda: self.prior_alpha(greedy))


class AutoSession:
    """One request's AUTO state: its α̂, and whether it speculates or waits to probe.
    Used by the request's own thread only."""

    def __init__(
        self, policy: AutoPolicy, ratios: Callable[[], tuple[float, dict[int, float]] | None], prior: Callable[[], float]
    ) -> None:
        self._policy = policy
        self._ratios = ratios
        self._prior = prior  # the service's α̂ now: it falls as soon as a draft misses everywhere
        self._accepted = 0.0
        self._rejected = 0.0
        self._pause_left = 0  # target-only tokens before the next probe; 0: not paused
        self._paused_gain = 0.0  # the best expected gain when the pause began
        self._probe_due = False
        self._next_pause = policy.first_pause_tokens
        self._streak = 0  # speculative rounds chosen since the last pause

    @property
    def alpha(self) -> float:
        w = self._policy.prior_weight
        return (self._accepted + w * self._prior()) / (self._accepted + self._rejected + w)

    def observe(self, k: int, accepted: int, emitted: int) -> None:
        """A round ran: k draft tokens (0: target-only), accepted of them, emitted tokens."""
        if k:
            d = self._policy.decay
            self._accepted = d * self._accepted + accepted
            self._rejected = d * self._rejected + (accepted < k)
        elif self._pause_left:
            self._pause_left = max(0, self._pause_left - emitted)
            self._probe_due = self._pause_left == 0

    def next(self) -> Choice:
        """The next round's k (before the caller caps it at what the output has left)."""
        if self._pause_left:
            return Choice(0, common_pb2.AUTO_CHOICE_LOW_GAIN, self._paused_gain, self.alpha)
        ratios = self._ratios()
        if ratios is None or self._probe_due:  # the draft's cost is not measured yet, or a stretch ended
            if self._probe_due:  # the text may have changed: start again from the service's α̂
                self._probe_due, self._accepted, self._rejected = False, 0.0, 0.0
            return Choice(self._policy.probe_k, common_pb2.AUTO_CHOICE_PROBE, 0.0, self.alpha)
        alpha = self.alpha
        k, gain = best_k(alpha, *ratios, self._policy.k_max)
        if gain >= self._policy.pause_below:
            self._streak += 1
            return Choice(k, common_pb2.AUTO_CHOICE_BEST_K, gain, alpha)
        if self._streak >= STEADY_ROUNDS:
            self._next_pause = self._policy.first_pause_tokens
        self._pause_left, self._paused_gain, self._streak = self._next_pause, gain, 0
        self._next_pause = min(2 * self._next_pause, self._policy.max_pause_tokens)
        return Choice(0, common_pb2.AUTO_CHOICE_LOW_GAIN, gain, alpha)
