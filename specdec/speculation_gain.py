"""The performance model of docs/design.md as functions: what a round of k draft tokens is
expected to yield, and which k yields most per unit time.

Terms:
  α     per-position acceptance probability (α̂ when estimated): accepted / (accepted + rejections)
  k     draft tokens proposed in a round (0: a target-only round)
  c     one draft token's cost / one target-only token's cost
  v(k)  one verification of k draft tokens (k+1 positions) / one target-only token's cost
  E(k)  = (1 - α^(k+1)) / (1 - α), expected tokens per round (accepted plus the closing one)
  r(k)  = (α + α² + … + α^k) / k = (E(k) - 1) / k, the expected acceptance rate
          (accepted / proposed), which falls as k grows for the same α
  gain  = E(k) / (k·c + v(k)), expected tokens per unit time relative to target-only
"""

from __future__ import annotations

from collections.abc import Mapping


def expected_tokens(alpha: float, k: int) -> float:
    """E(k): expected tokens a round of k draft tokens emits."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_acceptance_rate(alpha: float, k: int) -> float:
    """r(k): the acceptance rate (accepted / proposed) expected of rounds of k draft tokens."""
    return (expected_tokens(alpha, k) - 1.0) / k


def alpha_for_acceptance_rate(rate: float, k: int, tolerance: float = 1e-12) -> float:
    """The α whose expected acceptance rate at k is `rate` (0 <= rate <= 1), by bisection:
    r(k) rises monotonically with α from 0 to 1."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"an acceptance rate is in [0, 1], not {rate}")
    low, high = 0.0, 1.0
    while high - low > tolerance:
        mid = (low + high) / 2
        if expected_acceptance_rate(mid, k) < rate:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def gain(alpha: float, k: int, c: float, v: float) -> float:
    """Expected tokens per unit time of a round of k draft tokens, relative to
    target-only decoding; v is v(k)."""
    return expected_tokens(alpha, k) / (k * c + v)


def best_k(alpha: float, c: float, v: Mapping[int, float], k_max: int = 16) -> tuple[int, float]:
    """The k in 1..k_max (among those v has) with the largest gain, and that gain; the
    smallest such k on a tie."""
    candidates = [k for k in range(1, k_max + 1) if k in v]
    if not candidates:
        raise ValueError(f"v(k) is known for no k in 1..{k_max}")
    best = max(candidates, key=lambda k: (gain(alpha, k, c, v[k]), -k))
    return best, gain(alpha, best, c, v[best])
