"""The target model's sessions: prompts prefilled in chunks and the verification of every
session's round in ONE forward. Runs on the verify service's round thread only.

Between rounds a session's cache covers every token but the last; a round feeds that last
token plus the k draft tokens, which yields the target's distributions at the k+1 positions
that verification needs. Target-only rounds are the same step with k=0. A forward runs
the rounds of all sessions given and the next chunk of each prompt being prefilled, each
session over its own cache (specdec.runtime's forward_batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specdec.engine import run_each
from specdec.errors import FailedPrecondition, NotFound
from specdec.runtime import CausalLM, KVCache
from specdec.sampling import RoundOutcome, SamplingParams, coupling_noise, verify_round


@dataclass
class TargetSession:
    tokens: list[int]  # prompt and committed output; the cache covers all but the last once prefilled
    prompt_length: int  # tokens[prompt_length] is output position 0
    cache: KVCache
    params: SamplingParams
    generator: torch.Generator  # rejection sampling's draws (an unseeded sampled request)
    coupled_seed: int | None  # a seeded request's seed: its tokens are Gumbel-max choices

    @property
    def prefill_left(self) -> int:
        """Prompt positions not fed yet (the last prompt token is fed by the first round)."""
        return max(0, self.prompt_length - 1 - self.cache.length)


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
    capacity: int  # tokens the session reserves: prompt, output and the longest proposal's look-ahead
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
    seconds: float  # the shared forward plus this session's acceptance


@dataclass(frozen=True)
class Forwarded:
    """What one forward did: each round's outcome (or the exception that kept it out of
    the forward) in the order given, and the forward's shape."""

    verified: list[Verified | Exception]
    sessions: int  # sessions that shared the forward: rounds and prompt chunks
    positions: int  # positions it ran
    seconds: float  # its wall time (0 when nothing ran)
    context: float = 0.0  # cached tokens behind each of its sessions, on average


@dataclass
class Verifier:
    model: CausalLM
    sessions: dict[str, TargetSession] = field(default_factory=dict)
    rounds: int = 0
    prefills: int = 0  # forwards that carried prompt positions

    def execute(self, steps: list[Prefill | Verify | Release | Calibrate]) -> list[object]:
        """One step after another: a Prefill opens its session and feeds the whole prompt."""
        handlers = {
            Prefill: self._prefill_whole,
            Verify: self._verify_one,
            Release: self.release,
            Calibrate: lambda s: s.measure(),
        }
        return run_each(steps, handlers)

    def open(self, step: Prefill, cache: KVCache | None = None) -> TargetSession:
        """Opens the session on `cache` (a reservation taken at admission) or a new one
        (PoolExhausted when it does not fit); its prompt is fed by the next forwards
        (`forward`'s prefill chunks)."""
        if step.session_id in self.sessions:
            raise FailedPrecondition(f"target session {step.session_id!r} is already open")
        session = TargetSession(
            tokens=list(step.prompt_ids),
            prompt_length=len(step.prompt_ids),
            cache=cache if cache is not None else self.model.new_cache(step.capacity),
            params=step.params,
            generator=self.model.new_generator(step.seed),
            coupled_seed=step.seed if step.coupled else None,
        )
        self.sessions[step.session_id] = session
        return session

    def forward(self, rounds: Sequence[Verify], prefill: Mapping[str, int]) -> Forwarded:
        """ONE target forward over the k+1 positions of each round and the next
        `prefill[session]` prompt positions of each session being prefilled. A round that
        cannot run (unknown session, over its reservation, still prefilling) is left out
        of the forward with its exception; the others run."""
        outcomes: list[Verified | Exception | None] = [None] * len(rounds)
        caches: list[KVCache] = []
        feeds: list[list[int]] = []
        verifying: list[tuple[int, TargetSession, Verify]] = []
        for i, step in enumerate(rounds):
            try:
                session = self._session(step.session_id)
                if session.prefill_left:
                    raise FailedPrecondition(f"target session {step.session_id!r} is still prefilling")
                fed = session.tokens[session.cache.length :] + step.draft.ids
                if session.cache.length + len(fed) > session.cache.capacity:
                    raise FailedPrecondition(
                        f"session {step.session_id!r}: {session.cache.length + len(fed)} positions exceed its "
                        f"reservation of {session.cache.capacity}"
                    )
            except Exception as exc:
                outcomes[i] = exc
                continue
            caches.append(session.cache)
            feeds.append(fed)
            verifying.append((i, session, step))
        for sid, count in prefill.items():
            session = self.sessions[sid]
            start = session.cache.length
            caches.append(session.cache)
            feeds.append(session.tokens[start : start + min(count, session.prefill_left)])
        seconds = 0.0
        context = sum(cache.length for cache in caches) / len(caches) if caches else 0.0
        if caches:
            start_time = time.perf_counter()
            logits = self.model.forward_batch(caches, feeds)
            seconds = time.perf_counter() - start_time
            self.prefills += bool(prefill)
            for (i, session, step), session_logits in zip(verifying, logits):
                outcomes[i] = self.conclude(session, step, session_logits, seconds)
        return Forwarded(outcomes, len(caches), sum(len(f) for f in feeds), seconds, context)  # type: ignore[arg-type]

    def conclude(self, session: TargetSession, step: Verify, logits: torch.Tensor, forward_s: float) -> Verified:
        """Acceptance of one round from its forward's logits, then the commit."""
        start = time.perf_counter()
        draft = step.draft
        k = len(draft.ids)
        logits = logits[-(k + 1) :]  # [k+1, V]
        position = len(session.tokens) - session.prompt_length  # of the first verified token
        noise = coupling_noise(session.coupled_seed, session.params, position, k + 1, logits.shape[-1])
        outcome = verify_round(
            logits, session.params, draft.ids, draft.support_ids, draft.support_probs, session.generator, noise
        )
        self._commit(session, draft.ids, outcome)
        self.rounds += 1
        tokens = draft.ids[: outcome.accepted] + [outcome.token]
        return Verified(outcome.accepted, tokens, forward_s + time.perf_counter() - start)

    def release(self, step: Release) -> bool:
        session = self.sessions.pop(step.session_id, None)
        if session is None:
            return False
        session.cache.release()
        return True

    def _session(self, session_id: str) -> TargetSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"no target session {session_id!r}")
        return session

    def _prefill_whole(self, step: Prefill) -> None:
        session = self.open(step)
        if session.prefill_left:
            self.forward([], {step.session_id: session.prefill_left})

    def _verify_one(self, step: Verify) -> Verified:
        [outcome] = self.forward([step], {}).verified
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    @staticmethod
    def _commit(session: TargetSession, draft_ids: list[int], outcome: RoundOutcome) -> None:
        """Keeps the accepted draft positions in the cache and appends the round's tokens."""
        session.cache.rollback(len(session.tokens) + outcome.accepted)
        session.tokens += draft_ids[: outcome.accepted] + [outcome.token]
