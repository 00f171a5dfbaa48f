"""A batched step's costs as this service serves them, for AUTO's batch chooser
(specdec.batch_gain): the target forward's seconds by sessions, rows and context, from a
calibration at startup (specdec.costs.batch_forward_seconds, and context_ratios for a
longer context) scaled by how much slower served forwards run than it predicts; the
draft's as a call plus, for each batched draft step, a first session and each further
one, fitted to what the steps' proposals took (their wait, and what the draft computing
beside the rest of the step added to it); and the rest of a step (RPC, Python), measured.
Medians and fits over recent steps only, so the costs follow load as it moves.
Observed from the round loop's thread; read from it and, for AUTO's opening (the draft's
call, a loaded step's costs), from a request's thread, which reads copies of the samples."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from specdec.batch_gain import StepCosts, lower_hull

WINDOW = 32  # recent steps each measured cost is taken over
MIN_DRAFT_SAMPLES = 3  # steps with proposals before the draft's cost is trusted
MIN_REST_SAMPLES = 3  # target-only steps before their rest stands for every step's


def _along(points: list[tuple[int, float]], x: np.ndarray) -> np.ndarray:
    """Linear through sorted (x, y) points, extended beyond them at the end segments' slopes."""
    xs = np.array([p for p, _ in points], dtype=float)
    ys = np.array([q for _, q in points])
    if len(points) == 1:
        return np.full(x.shape, ys[0])
    below = ys[0] + (ys[1] - ys[0]) * (x - xs[0]) / (xs[1] - xs[0])
    above = ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2])
    return np.where(x < xs[0], below, np.where(x > xs[-1], above, np.interp(x, xs, ys)))


@dataclass(frozen=True)
class ContextCost:
    """What a forward adds per token of context beyond the calibration's: attention reads
    each session's cached keys and values (per session) and scores every row against them
    (per row). Both by least squares over forwards timed at a longer context."""

    context: int  # the calibration's cached tokens behind each session
    per_session: float = 0.0  # seconds per session per further context token
    per_row: float = 0.0  # seconds per row per further context token

    @classmethod
    def fitted(
        cls, context: int, forward_s: Mapping[tuple[int, int], float], longer: int,
        slower: Mapping[tuple[int, int], float],
    ) -> ContextCost:  # fmt: skip
        """From forwards' seconds by (sessions, positions each) at `context` and how many
        times slower the same shapes run at `longer`."""
        shapes = [shape for shape in slower if shape in forward_s]
        if longer <= context or not shapes:
            return cls(context)
        x = np.array([(s, s * p) for s, p in shapes], dtype=float) * (longer - context)
        y = np.array([forward_s[shape] * (slower[shape] - 1.0) for shape in shapes])
        (per_session, per_row), *_ = np.linalg.lstsq(x, y, rcond=None)
        return cls(context, max(0.0, float(per_session)), max(0.0, float(per_row)))

    def seconds(self, sessions: int, rows: np.ndarray, context: float) -> np.ndarray:
        return (self.per_session * sessions + self.per_row * rows) * (context - self.context)


class ServedStepCosts:
    def __init__(self, forward_s: Mapping[tuple[int, int], float], context: ContextCost | None = None) -> None:
        """forward_s: calibrated seconds of a forward by (sessions, new positions each);
        context: what a longer context adds to them (none: context is left to the served scale)."""
        if not forward_s:
            raise ValueError("ServedStepCosts needs at least one calibrated forward")
        self._context = context
        curves: dict[int, list[tuple[int, float]]] = {}
        for (sessions, positions), seconds in forward_s.items():
            curves.setdefault(sessions, []).append((sessions * positions, seconds))
        # Each count's curve made convex (its lower hull): the chooser prices rows on a convex
        # cost, and the served scale must be taken against the same curve it scales.
        self._curves = {s: lower_hull(sorted(points)) for s, points in sorted(curves.items())}
        self._scale: deque[float] = deque(maxlen=WINDOW)  # served forward / predicted
        self._draft: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (K, Σk, seconds)
        self._rest: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (sessions, seconds) of target-only steps
        self._rest_any: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # and of every step

    def forward(self, sessions: int, rows: int, context: float | None = None) -> float:
        """Predicted seconds of a served forward over `rows` rows of `sessions` sessions
        behind `context` cached tokens each on average (None: the calibration's): along each
        calibrated session count's curve, then linear between the two counts around
        `sessions` (the nearest one outside them), plus the context's cost, times the
        served scale."""
        rows_ = np.array([rows], dtype=float)
        return float(self._predicted(sessions, rows_, context)[0]) * self._served_scale()

    def _served_scale(self) -> float:
        return statistics.median(self._scale) if self._scale else 1.0

    def _predicted(self, sessions: int, rows: np.ndarray, context: float | None) -> np.ndarray:
        """The calibration's seconds over each of `rows` at `context`, unscaled; a context
        shorter than the calibration's takes off at most half of them."""
        base = self._forwards(sessions, rows)
        if self._context is None or context is None:
            return base
        return np.maximum(base + self._context.seconds(sessions, rows, context), 0.5 * base)

    def _forwards(self, sessions: int, rows: np.ndarray) -> np.ndarray:
        """The calibration's seconds of forwards over each of `rows`, unscaled."""
        counts = list(self._curves)
        below = max((s for s in counts if s <= sessions), default=counts[0])
        above = min((s for s in counts if s >= sessions), default=counts[-1])
        low, high = _along(self._curves[below], rows), _along(self._curves[above], rows)
        return low if above == below else low + (high - low) * (sessions - below) / (above - below)

    def observe_forward(self, sessions: int, rows: int, seconds: float, context: float | None = None) -> None:
        """A served forward behind `context` cached tokens per session on average: how much
        slower (or faster) than the calibration predicts."""
        predicted = float(self._predicted(sessions, np.array([rows], dtype=float), context)[0])
        if predicted > 0:
            self._scale.append(seconds / predicted)

    def observe_overhead(
        self, sessions: int, rest_s: float, steps: int = 0, proposed: int = 0, wait_s: float = 0.0
    ) -> None:
        """What came before a step since the forward of the step before, of `sessions`
        rounds: `rest_s` (commits, spans, hand-over, planning) and, where the draft ran
        `steps` batched steps for `proposed` tokens (the largest k, Σk), the wait for them.
        The draft computes during the rest and, where the cores are few, slows it: its cost
        is the wait plus what the rest took beyond a target-only step's (once those are
        measured: on two cores about 0.4 ms per draft step that the wait alone missed)."""
        self.observe_rest(sessions, rest_s, drafting=steps > 0)
        if steps > 0:
            # Unclipped: the rest's noise either way averages out in the draft's line
            beyond = rest_s - self._rest_at(self._rest, sessions) if self._rest_measured() else 0.0
            self.observe_draft(steps, proposed, max(0.0, wait_s + beyond))

    def observe_draft(self, steps: int, proposed: int, seconds: float) -> None:
        """A step's proposals: the draft ran `steps` batched steps (the largest k) for
        `proposed` draft tokens in all (Σk) at a cost of `seconds`."""
        if steps > 0:
            self._draft.append((steps, proposed, seconds))

    def observe_rest(self, sessions: int, seconds: float, drafting: bool = False) -> None:
        """A step of `sessions` rounds: its time beyond its forward and its wait for
        proposals; `drafting`: the draft computed meanwhile."""
        sample = (sessions, max(0.0, seconds))
        self._rest_any.append(sample)
        if not drafting:
            self._rest.append(sample)

    def _rest_measured(self) -> bool:
        return len(self._rest) >= MIN_REST_SAMPLES

    def rest(self, sessions: int) -> float:
        """A step's rest at `sessions` rounds, the draft's part aside: from target-only steps
        once a few were measured, else from every step."""
        return self._rest_at(self._rest if self._rest_measured() else self._rest_any, sessions)

    @staticmethod
    def _rest_at(rests: deque[tuple[int, float]], sessions: int) -> float:
        """A fixed part plus one per round (committing, the spans, the hand-over), by least
        squares where the steps had different counts and neither part fits negative; else
        their median."""
        samples = list(rests)  # a copy: AUTO's opening asks from the request's thread
        if not samples:
            return 0.0
        x = np.array([(1.0, n) for n, _ in samples])
        y = np.array([seconds for _, seconds in samples])
        if np.linalg.matrix_rank(x) == 2:
            (fixed, per), *_ = np.linalg.lstsq(x, y, rcond=None)
            if fixed >= 0 and per >= 0:
                return float(fixed + per * sessions)
        return float(np.median(y))

    def draft_line(self) -> tuple[float, float, float] | None:
        """(seconds per call, per batched draft step of one session, per further session in
        a step): a call plus, for each of the K steps, its first session's cost plus one per
        further session, by least squares over recent steps: the fullest set of these terms
        that the samples tell apart (not when every step had one session, Σk = K; not when
        every K was the same) and that fits none negative (of two terms, the pair with the
        least residual among those with the first session's); None until MIN_DRAFT_SAMPLES
        steps. Failing all, a draft step costs the median of wait / K."""
        samples = list(self._draft)  # a copy: AUTO's opening asks from the request's thread
        if len(samples) < MIN_DRAFT_SAMPLES:
            return None
        x = np.array([(1.0, k, total - k) for k, total, _ in samples])
        y = np.array([seconds for *_, seconds in samples])
        for size in (3, 2):  # all three terms where they fit; else the pair that fits the samples best
            fits = []
            # Every pair prices a step's first session: a draft step is never free, and a line
            # without that term would let the chooser deepen one session's k at no cost.
            for terms in (t for t in combinations(range(3), size) if 1 in t):
                if np.linalg.matrix_rank(x[:, terms]) < size:
                    continue
                coef, *_ = np.linalg.lstsq(x[:, terms], y, rcond=None)
                if (coef >= -1e-9 * float(np.abs(y).max())).all():  # exact samples fit zeros as ±1e-18
                    residual = float(np.sum((x[:, terms] @ coef - y) ** 2))
                    fits.append((residual, dict(zip(terms, np.clip(coef, 0.0, None).tolist()))))
            if fits:
                fitted = min(fits, key=lambda fit: fit[0])[1]
                return fitted.get(0, 0.0), fitted.get(1, 0.0), fitted.get(2, 0.0)
        return 0.0, statistics.median(seconds / k for k, _, seconds in samples), 0.0

    def step_costs(
        self, sessions: int, k_max: int, other_rows: int = 0, context: float | None = None
    ) -> StepCosts | None:
        """The StepCosts of a step of `sessions` rounds behind `context` cached tokens each
        on average, beside `other_rows` rows of prompt chunks, for the chooser (rows counted
        as it counts them, n + Σk); None until the draft's cost is known."""
        line = self.draft_line()
        if line is None:
            return None
        rows = np.arange(sessions, sessions * (k_max + 1) + 1)
        seconds = self._predicted(sessions, (rows + other_rows).astype(float), context) * self._served_scale()
        points = tuple(zip(rows.tolist(), seconds.tolist()))
        call, first, further = line
        # A first session cheaper than a further one (a device one session leaves idle and a
        # few saturate) is priced as a further one: the chooser's per-step part is never
        # negative, so it errs towards a smaller k.
        fixed, rest = max(0.0, first - further), self.rest(sessions)
        return StepCosts(points, draft_call=call, draft_fixed=fixed, draft_per_session=further, rest=rest)
