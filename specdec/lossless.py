"""Checks that a speculative greedy completion equals the target-only one, and when it
does not, says whether the divergence is an fp32 near-tie (docs/design.md) or a bug."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.runtime import CausalLM

NEAR_TIE = 1e-4  # top-2 logit gap at or below which an argmax flip is rounding, not a bug


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the completion
    expected: int  # target-only token
    got: int  # speculative token
    top2_gap: float  # target's top-1 minus top-2 logit there, from a full recompute

    @property
    def near_tie(self) -> bool:
        return self.top2_gap <= NEAR_TIE


def first_divergence(
    target: CausalLM, prompt_ids: Sequence[int], expected: Sequence[int], got: Sequence[int]
) -> Divergence | None:
    """None when the completions agree over their common length and have equal length."""
    for position, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            break
    else:
        if len(expected) == len(got):
            return None
        position = min(len(expected), len(got))
        return Divergence(position, -1, -1, float("inf"))
    logits = target.forward(target.new_cache(), [*prompt_ids, *expected[:position]])[-1]
    top2 = logits.topk(2).values
    return Divergence(position, expected[position], got[position], float(top2[0] - top2[1]))
