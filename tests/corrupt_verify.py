"""Runs the verify service with a deliberately broken verification step, for the test
that proves the benchmark's greedy equality check fails when it should: every fifth
speculative round that accepted a draft token streams a wrong first token.

    python tests/corrupt_verify.py <the verify service's own flags>
"""

from __future__ import annotations

import sys

import torch

from verify_service import server
from verify_service.verifier import TargetSession, Verified, Verifier, Verify

_conclude = Verifier.conclude
_rounds = 0


def corrupted_conclude(
    self: Verifier, session: TargetSession, step: Verify, logits: torch.Tensor, forward_s: float
) -> Verified:
    global _rounds
    verified = _conclude(self, session, step, logits, forward_s)
    if step.draft.ids and verified.accepted:
        _rounds += 1
        if _rounds % 5 == 0:
            wrong = (verified.tokens[0] + 1) % self.model.vocab_size
            return Verified(verified.accepted, [wrong, *verified.tokens[1:]], verified.seconds)
    return verified


if __name__ == "__main__":
    Verifier.conclude = corrupted_conclude
    sys.exit(server.main())
