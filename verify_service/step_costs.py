"""A batched step's costs as this service serves them, for AUTO's batch chooser
(specdec.batch_gain): the target forward's seconds by sessions and rows, from a calibration
at startup (specdec.costs.batch_forward_seconds) scaled by how much slower served forwards
run than it predicts; the draft's batched steps as a fixed cost plus one per session, fitted
to what the step's proposals took; and the rest of a step (RPC, Python), measured. Medians
and fits over recent steps only, so the costs follow load and context lengths as they move.
Used from the round loop's thread only."""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Mapping

from specdec.batch_gain import StepCosts

WINDOW = 32  # recent steps each measured cost is taken over
MIN_DRAFT_SAMPLES = 3  # steps with proposals before the draft's cost is trusted


def _along(points: list[tuple[int, float]], x: float) -> float:
    """Linear through sorted (x, y) points, extended beyond them at the end segments' slopes."""
    if len(points) == 1:
        return points[0][1]
    for (x1, y1), (x2, y2) in itertools.pairwise(points):
        if x <= x2 or (x2, y2) == points[-1]:
            return y1 + (y2 - y1) * (x - x1) / (x2 - x1)
    raise AssertionError("unreachable")


class ServedStepCosts:
    def __init__(self, forward_s: Mapping[tuple[int, int], float]) -> None:
        """forward_s: calibrated seconds of a forward by (sessions, new positions each)."""
        if not forward_s:
            raise ValueError("ServedStepCosts needs at least one calibrated forward")
        curves: dict[int, list[tuple[int, float]]] = {}
        for (sessions, positions), seconds in forward_s.items():
            curves.setdefault(sessions, []).append((sessions * positions, seconds))
        self._curves = {s: sorted(points) for s, points in sorted(curves.items())}
        self._scale: deque[float] = deque(maxlen=WINDOW)  # served forward / predicted
        self._draft: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (K, Σk, seconds)
        self._rest: deque[float] = deque(maxlen=WINDOW)

    def forward(self, sessions: int, rows: int) -> float:
        """Predicted seconds of a served forward over `rows` rows of `sessions` sessions:
        along each calibrated session count's curve, then linear between the two counts
        around `sessions` (the nearest one outside them), times the served scale."""
        counts = list(self._curves)
        below = max((s for s in counts if s <= sessions), default=counts[0])
        above = min((s for s in counts if s >= sessions), default=counts[-1])
        low, high = _along(self._curves[below], rows), _along(self._curves[above], rows)
        seconds = low if above == below else low + (high - low) * (sessions - below) / (above - below)
        return seconds * (statistics.median(self._scale) if self._scale else 1.0)

    def observe_forward(self, sessions: int, rows: int, seconds: float) -> None:
        """A served forward: how much slower (or faster) than the calibration predicts."""
        predicted = self.forward(sessions, rows) / (statistics.median(self._scale) if self._scale else 1.0)
        if predicted > 0:
            self._scale.append(seconds / predicted)

    def observe_draft(self, steps: int, proposed: int, seconds: float) -> None:
        """A step's proposals: the draft ran `steps` batched steps (the largest k) for
        `proposed` draft tokens in all (Σk) in `seconds`."""
        if steps > 0:
            self._draft.append((steps, proposed, seconds))

    def observe_rest(self, seconds: float) -> None:
        """A step's time beyond its forward and its wait for proposals."""
        self._rest.append(max(0.0, seconds))

    def draft_line(self) -> tuple[float, float] | None:
        """(seconds per batched draft step, seconds per session in it), by least squares
        over recent steps (non-negative); None until MIN_DRAFT_SAMPLES steps. While every
        sample has one session per draft step, all of a step's cost is taken as fixed."""
        if len(self._draft) < MIN_DRAFT_SAMPLES:
            return None
        xs = [(float(k), float(total)) for k, total, _ in self._draft]
        ys = [seconds for *_, seconds in self._draft]
        saa = sum(a * a for a, _ in xs)
        sbb = sum(b * b for _, b in xs)
        sab = sum(a * b for a, b in xs)
        say = sum(a * y for (a, _), y in zip(xs, ys))
        sby = sum(b * y for (_, b), y in zip(xs, ys))
        det = saa * sbb - sab * sab
        if det <= 1e-9 * saa * sbb:  # Σk proportional to K in every sample: no per-session term to tell apart
            return sum(ys) / sum(a for a, _ in xs), 0.0
        fixed, per = (say * sbb - sby * sab) / det, (sby * saa - say * sab) / det
        if per < 0:
            return sum(ys) / sum(a for a, _ in xs), 0.0
        if fixed < 0:
            return 0.0, sum(ys) / sum(b for _, b in xs)
        return fixed, per

    def step_costs(self, sessions: int, k_max: int, other_rows: int = 0) -> StepCosts | None:
        """The StepCosts of a step of `sessions` rounds beside `other_rows` rows of prompt
        chunks, for the chooser (rows counted as it counts them, n + Σk); None until the
        draft's cost is known."""
        line = self.draft_line()
        if line is None:
            return None
        points = tuple(
            (sessions + extra, self.forward(sessions, sessions + extra + other_rows))
            for extra in range(sessions * k_max + 1)
        )
        rest = statistics.median(self._rest) if self._rest else 0.0
        return StepCosts(verify_points=points, draft_fixed=line[0], draft_per_session=line[1], rest=rest)
