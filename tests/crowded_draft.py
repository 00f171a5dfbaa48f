"""Runs the draft service as a draft that is cheap alone and dear in company: every batched
forward of n > 1 sessions waits CROWDING_S for each of them, as a draft whose device one
session leaves idle and two saturate would. The batch chooser should then hold sessions at
k = 0 while several are in flight, and a session left alone should speculate at once.

    python tests/crowded_draft.py <the draft service's own flags>
"""

from __future__ import annotations

import sys
import time

from draft_service import server
from draft_service.drafter import Drafter, Proposals, ProposeBatch

CROWDING_S = 0.010

_propose_batch = Drafter.propose_batch


def crowded_propose_batch(self: Drafter, step: ProposeBatch) -> Proposals:
    proposals = _propose_batch(self, step)
    time.sleep(CROWDING_S * sum(sessions for sessions, _ in proposals.shapes if sessions > 1))
    return proposals


if __name__ == "__main__":
    Drafter.propose_batch = crowded_propose_batch
    sys.exit(server.main())
