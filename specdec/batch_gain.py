"""The performance model of a batched step (docs/design.md, "AUTO for a batch"): which k
each session of a step runs so that the step commits the most tokens per second.

Terms (each session i of the step, n sessions):
  α_i   the session's per-position acceptance probability (its α̂)
  k_i   draft tokens it proposes this step (0: it runs target-only this step)
  K     max k_i: the draft runs K batched steps, step j carrying the sessions with k_i ≥ j
  E_i   = E(α_i, k_i) = (1 - α_i^(k_i+1)) / (1 - α_i), its expected committed tokens
  T(k)  = rest + [K > 0]·draft_call + draft_fixed·K + draft_per_session·Σk_i
          + verify(n + Σk_i), the step's expected seconds: its own overhead, the draft's
          (one call for the step's proposals, then K batched steps, each a fixed cost plus
          one per session in it) and one target forward over every session's k_i + 1
          positions
  goodput = Σ E_i / T(k), committed tokens per second

The chooser maximises goodput exactly when verify is convex in its rows (a forward's cost
per extra row does not fall as rows are added), which `StepCosts` enforces by taking the
lower convex hull of the measured points. Dinkelbach's method: for the current goodput λ,
maximise Σ E_i - λ·T(k) over k; for each K that splits into a marginal allocation (the
step's extra rows go, one at a time, to the session whose next draft token is likeliest
to be kept, α_i^(k_i+1), while that beats λ times the row's cost: the kept-token values
fall and the costs do not, so the greedy prefix is optimal), then λ becomes the goodput of
the best k, until it stops rising. With one session it is specdec.speculation_gain's
E(k) / (k·c + v(k)) in seconds instead of target-only tokens.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.speculation_gain import expected_tokens


def lower_hull(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The lower convex hull of (rows, seconds) points sorted by rows."""
    hull: list[tuple[int, float]] = []
    for x, y in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (x - x1) >= (y - y1) * (x2 - x1):  # hull[-1] is on or above the chord
                hull.pop()
            else:
                break
        hull.append((x, y))
    return hull


@dataclass(frozen=True)
class StepCosts:
    """A step's costs, in seconds. verify_points: (rows, seconds of a target forward over
    that many rows) for this step's sessions and contexts, at least one point; between
    points the cost is linear, beyond the last it grows at the last segment's slope."""

    verify_points: tuple[tuple[int, float], ...]
    draft_call: float = 0.0  # the draft's cost of a step with any proposal, whatever its k
    draft_fixed: float = 0.0  # one batched draft step's cost regardless of its sessions
    draft_per_session: float = 0.0  # what each session in a draft step adds
    rest: float = 0.0  # the step's overhead beyond its forwards (RPC, Python)
    _hull: list[tuple[int, float]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.verify_points:
            raise ValueError("StepCosts needs at least one verify point")
        object.__setattr__(self, "_hull", lower_hull(sorted(self.verify_points)))

    def verify(self, rows: int) -> float:
        """Seconds of one target forward over `rows` rows (the convex hull of the points)."""
        hull = self._hull
        if len(hull) == 1:
            return hull[0][1]
        i = min(max(bisect.bisect_left(hull, (rows, float("-inf"))), 1), len(hull) - 1)
        (x1, y1), (x2, y2) = hull[i - 1], hull[i]
        return y1 + (y2 - y1) * (rows - x1) / (x2 - x1)

    def verify_many(self, rows: np.ndarray) -> np.ndarray:
        """verify() of each of `rows`."""
        xs = np.array([x for x, _ in self._hull], dtype=float)
        ys = np.array([y for _, y in self._hull])
        if len(xs) == 1:
            return np.full(len(rows), ys[0])
        inside = np.interp(rows, xs, ys)
        below = ys[0] + (ys[1] - ys[0]) * (rows - xs[0]) / (xs[1] - xs[0])
        above = ys[-1] + (ys[-1] - ys[-2]) * (rows - xs[-1]) / (xs[-1] - xs[-2])
        return np.where(rows < xs[0], below, np.where(rows > xs[-1], above, inside))

    def step(self, ks: Sequence[int]) -> float:
        """T(k): the step's expected seconds when its sessions propose ks."""
        return (
            self.rest + (self.draft_call if any(ks) else 0.0) + self.draft_fixed * max(ks, default=0)
            + self.draft_per_session * sum(ks)
            + self.verify(len(ks) + sum(ks))
        )  # fmt: skip


def goodput(alphas: Sequence[float], ks: Sequence[int], costs: StepCosts) -> float:
    """Σ E_i / T(k): the step's expected committed tokens per second."""
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks)) / costs.step(ks)


def _best_for(
    alphas: Sequence[float], costs: StepCosts, k_max: int, low: Sequence[int], high: Sequence[int], lam: float
) -> list[int]:
    """The k maximising Σ E_i - lam·T(k), low[i] ≤ k_i ≤ high[i], for every K (the draft's
    steps, paid once whatever the rows) at once: a row of the arrays below per K."""
    n = len(alphas)
    rows = n + sum(low)
    tops = np.arange(max(low, default=0), k_max + 1)
    base = sum(expected_tokens(a, k) for a, k in zip(alphas, low)) - lam * (
        costs.rest + costs.draft_call * (tops > 0) + costs.draft_fixed * tops
        + costs.draft_per_session * sum(low) + costs.verify(rows)
    )  # fmt: skip
    # Every extra row a session could take, likeliest kept first (for one session α^(k+1)
    # falls with k); under each K the rows up to it are taken in that order while the
    # kept-token value beats lam times what the row adds (a prefix: the values fall, the
    # costs do not).
    session = np.repeat(np.arange(n), [max(0, h - lo) for lo, h in zip(low, high)])
    step = np.concatenate([np.arange(lo + 1, h + 1) for lo, h in zip(low, high)] + [np.zeros(0, int)])
    kept = np.asarray(alphas, dtype=float)[session] ** step
    order = np.argsort(-kept, kind="stable")
    session, step, kept = session[order], step[order], kept[order]
    verify = costs.verify_many(np.arange(rows, rows + len(kept) + 1))
    added = costs.draft_per_session + np.diff(verify)  # the cost of the (m+1)-th extra row
    offered = step[None, :] <= tops[:, None]  # K × offers
    place = np.maximum(np.cumsum(offered, axis=1) - 1, 0)  # an offer's place among K's
    net = kept[None, :] - lam * added[place]
    failing = offered & (net <= 0)
    stop = np.where(failing.any(axis=1), failing.argmax(axis=1), len(kept)) if len(kept) else np.zeros(len(tops), int)
    taken = offered & (np.arange(len(kept))[None, :] < stop[:, None])
    value = base + np.where(taken, net, 0.0).sum(axis=1)
    # Charged K = top even where no session reached it: that k is also tried with its own K.
    best = int(np.argmax(value))
    return [lo + int(c) for lo, c in zip(low, np.bincount(session[taken[best]], minlength=n))]


def choose_ks(
    alphas: Sequence[float],
    costs: StepCosts,
    k_max: int,
    caps: Sequence[int] | None = None,
    floors: Sequence[int] | None = None,
) -> tuple[list[int], float]:
    """Every session's k maximising the step's goodput, and that goodput: floors[i] ≤ k_i ≤
    min(k_max, caps[i]). caps: each session's own limit (the tokens its output has left;
    0 for a session without a draft); floors: a k the session must run (its request's own
    k where it asked for one: set its cap to the same), 0 by default."""
    n = len(alphas)
    high = [k_max] * n if caps is None else [min(k_max, c) for c in caps]
    low = [0] * n if floors is None else list(floors)
    if len(high) != n or len(low) != n:
        raise ValueError(f"one cap and one floor per session: {len(high)} caps, {len(low)} floors, {n} sessions")
    if any(lo > hi for lo, hi in zip(low, high)):
        raise ValueError(f"a floor above its cap: floors {low}, caps {high}")
    if not n:
        return [], 0.0
    ks = list(low)
    lam = goodput(alphas, ks, costs)
    for _ in range(64):  # Dinkelbach rises strictly until the optimum; a few rounds in practice
        candidate = _best_for(alphas, costs, k_max, low, high, lam)
        value = goodput(alphas, candidate, costs)
        if value <= lam * (1 + 1e-12):
            break
        ks, lam = candidate, value
    return ks, lam
