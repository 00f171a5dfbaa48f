"""The target model's sessions: prefill and one verification forward per round.
Runs on the verify service's engine thread only.

Between rounds a session's cache covers every token but the last; a round feeds that last
token plus the k draft tokens in ONE forward, which yields the target's distributions at
the k+1 positions that verification needs. Target-only rounds are the same step with k=0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.engine import run_each
from specdec.errors import NotFound
from specdec.runtime import CausalLM, KVCache
from specdec.sampling import RoundOutcome, SamplingParams, coupling_noise, verify_round


@dataclass
class TargetSession:
    tokens: list[int]  # prompt and committed output; the cache covers all but the last
    prompt_length: int  # tokens[prompt_length] is output position 0
    cache: KVCache
    params: SamplingParams
    generator: torch.Generator  # rejection sampling's draws (an unseeded sampled request)
    coupled_seed: int | None  # a seeded request's seed: its tokens are Gumbel-max choices


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens and, when sampling, the sparse distribution each was drawn from."""

    ids: list[int]
    support_ids: list[list[int]]  # per token; empty lists when greedy
    support_probs: list[list[float]]


NO_DRAFT = DraftProposal([], [], [])


@dataclass(frozen=True)
class Prefill:
    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    capacity: int  # longest the sequence may grow (prompt plus output)
    coupled: bool = False  # a seeded request: sample by coupling (specdec.sampling) with this seed


@dataclass(frozen=True)
class Verify:
    session_id: str
    draft: DraftProposal  # NO_DRAFT for a target-only round


@dataclass(frozen=True)
class Release:
    session_id: str


@dataclass(frozen=True)
class Calibrate:
    """A measurement to run on the model's thread (at startup, before any session)."""

    measure: Callable[[], object]


@dataclass(frozen=True)
class Verified:
    accepted: int  # draft tokens accepted
    tokens: list[int]  # accepted draft tokens, then the closing token
    seconds: float  # forward plus acceptance


@dataclass
class Verifier:
    model: CausalLM
    sessions: dict[str, TargetSession] = field(default_factory=dict)
    rounds: int = 0
    prefills: int = 0

    def execute(self, steps: list[Prefill | Verify | Release]) -> list[object]:
        return run_each(
            steps, {Prefill: self.prefill, Verify: self.verify, Release: self.release, Calibrate: lambda step: step.measure()}
        )

    def prefill(self, step: Prefill) -> None:
        cache = self.model.new_cache(step.capacity)
        if len(step.prompt_ids) > 1:
            self.model.forward(cache, step.prompt_ids[:-1])
            self.prefills += 1
        self.sessions[step.session_id] = TargetSession(
            tokens=list(step.prompt_ids),
            prompt_length=len(step.prompt_ids),
            cache=cache,
            params=step.params,
            generator=self.model.new_generator(step.seed),
            coupled_seed=step.seed if step.coupled else None,
        )

    def verify(self, step: Verify) -> Verified:
        start = time.perf_counter()
        session = self.sessions.get(step.session_id)
        if session is None:
            raise NotFound(f"no target session {step.session_id!r}")
        draft = step.draft
        k = len(draft.ids)
        fed = session.tokens[session.cache.length :] + draft.ids
        logits = self.model.forward(session.cache, fed)[-(k + 1) :]  # [k+1, V]
        position = len(session.tokens) - session.prompt_length  # of the first verified token
        noise = coupling_noise(session.coupled_seed, session.params, position, k + 1, logits.shape[-1])
        outcome = verify_round(
            logits, session.params, draft.ids, draft.support_ids, draft.support_probs, session.generator, noise
        )
        self._commit(session, draft.ids, outcome)
        self.rounds += 1
        return Verified(outcome.accepted, draft.ids[: outcome.accepted] + [outcome.token], time.perf_counter() - start)

    def release(self, step: Release) -> bool:
        return self.sessions.pop(step.session_id, None) is not None

    @staticmethod
    def _commit(session: TargetSession, draft_ids: list[int], outcome: RoundOutcome) -> None:
        """Keeps the accepted draft positions in the cache and appends the round's tokens."""
        session.cache.rollback(len(session.tokens) + outcome.accepted)
        session.tokens += draft_ids[: outcome.accepted] + [outcome.token]
