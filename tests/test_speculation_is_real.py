"""With a draft that has the target's own weights, every greedy proposal is accepted: the
acceptance rate is 1.0, a request of n tokens takes ceil(n/(k+1)) rounds, and the
verify service runs one target forward per round (plus the prefill)."""

from __future__ import annotations

import math

import pytest

from specdec.v1 import common_pb2
from tests.helpers import request, run, verify_info


@pytest.fixture(scope="module")
def stack(toy, stack_factory):
    return stack_factory(toy.target, toy.same, args={"verify": ["--draft-deadline-min-ms", "10000"]})


@pytest.mark.parametrize("k,n", [(1, 40), (4, 50), (8, 61)])
def test_same_weights_draft_accepts_everything(stack, k, n):
    reference = run(stack, request("The quick brown fox", max_new_tokens=n, speculation=False))
    before = verify_info(stack)
    spec = run(stack, request("The quick brown fox", max_new_tokens=n, k=k))
    after = verify_info(stack)

    assert spec.token_ids == reference.token_ids
    assert spec.usage.acceptance_rate == 1.0
    assert spec.usage.rounds == math.ceil(n / (k + 1))
    assert spec.usage.draft_tokens_proposed == n - spec.usage.rounds
    assert all(m.round.closing == common_pb2.CLOSING_TOKEN_BONUS for m in spec.messages)
    assert after.rounds - before.rounds == spec.usage.rounds
    assert after.target_forwards - before.target_forwards == spec.usage.rounds + 1
    assert after.prefills - before.prefills == 1
    assert reference.usage.rounds == n  # target-only: one token per round
