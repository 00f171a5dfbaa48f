"""Runs the draft service with a fault injected into one kind of session, for the tests
that prove one session's failure stays with that session: a proposal for a session whose
prompt starts with FAULT_PROMPT raises inside the draft's engine step, as a bug would.

    python tests/faulty_draft.py <the draft service's own flags>
"""

from __future__ import annotations

import sys

from draft_service import server
from draft_service.drafter import Drafter, Propose

FAULT_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
FAULT_TEXT = "injected fault: this text must never reach a client"

_commit = Drafter.commit


def faulty_commit(self: Drafter, step: Propose) -> object:
    session = self.sessions.get(step.session_id)
    if session is not None and session.tokens[: len(FAULT_PROMPT)] == FAULT_PROMPT:
        raise RuntimeError(FAULT_TEXT)
    return _commit(self, step)


if __name__ == "__main__":
    Drafter.commit = faulty_commit
    sys.exit(server.main())
