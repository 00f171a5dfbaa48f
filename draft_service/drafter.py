"""The draft model's sessions and proposals. Runs on the draft service's engine thread only."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specdec.engine import run_each
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.runtime import CausalLM, KVCache
from specdec.sampling import SamplingParams, coupling_noise, propose_token
from specdec.v1 import draft_pb2


@dataclass
class DraftSession:
    tokens: list[int]  # committed tokens, then the latest proposal
    committed: int  # how many of `tokens` the verifier has committed
    prompt_length: int  # tokens[prompt_length] is output position 0
    cache: KVCache  # covers tokens[:cache.length]
    params: SamplingParams
    generator: torch.Generator  # the draft's own draws (an unseeded sampled request)
    coupled_seed: int | None  # a seeded request's seed: proposals use its Gumbel noise
    last_used: float  # monotonic time of the open or the latest proposal


@dataclass(frozen=True)
class Open:
    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed when coupled, else a seed of the draft's own draws
    capacity: int  # longest the sequence may grow; 0 = the model's context
    coupled: bool = False  # a seeded request: propose with the noise the target uses


@dataclass(frozen=True)
class Propose:
    session_id: str
    accepted: int
    appended_ids: list[int]
    num_tokens: int


@dataclass(frozen=True)
class ProposeBatch:
    """One step of every speculating session: they share each draft forward."""

    sessions: list[Propose]


@dataclass(frozen=True)
class Proposals:
    tokens: list[list[draft_pb2.DraftToken] | Exception]  # per session of the batch, in its order
    shapes: list[tuple[int, int]]  # (sessions, positions) of each draft forward the batch ran


@dataclass(frozen=True)
class Close:
    session_id: str


@dataclass(frozen=True)
class Expire:
    idle_s: float  # close sessions unused for longer than this


FORGET_AFTER = 4096  # expired or closed-before-opened session ids remembered


@dataclass
class Drafter:
    model: CausalLM
    support_size: int
    max_sessions: int = 64
    sessions: dict[str, DraftSession] = field(default_factory=dict)
    proposals: int = 0
    expirations: int = 0
    expired: OrderedDict[str, float] = field(default_factory=OrderedDict)  # recent ones: session id -> idle seconds
    # Closes that arrived before their open (both calls waited in a stalled process and
    # ran in either order): that open must not create a session nobody will close.
    closed_unopened: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def execute(self, steps: list[Open | Propose | ProposeBatch | Close | Expire]) -> list[object]:
        handlers = {
            Open: self.open,
            Propose: self.propose,
            ProposeBatch: self.propose_batch,
            Close: self.close,
            Expire: self.expire,
        }
        return run_each(steps, handlers)

    def open(self, step: Open) -> float:
        """Creates the session and prefills all but the last prompt token; returns seconds."""
        if len(self.sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"{len(self.sessions)} draft sessions are open, the limit (--max-sessions) is {self.max_sessions}"
            )
        if not step.prompt_ids:
            raise InvalidArgument("prompt_ids: must not be empty")
        if len(step.prompt_ids) >= self.model.max_positions:
            raise InvalidArgument(
                f"prompt_ids: {len(step.prompt_ids)} tokens do not fit the draft's context of {self.model.max_positions}"
            )
        if step.session_id in self.sessions:
            raise FailedPrecondition(f"session {step.session_id!r} is already open")
        if step.session_id in self.closed_unopened:
            raise FailedPrecondition(f"session {step.session_id!r} was closed before it was opened")
        start = time.perf_counter()
        cache = self.model.new_cache(step.capacity or None)
        if len(step.prompt_ids) > 1:
            self.model.forward(cache, step.prompt_ids[:-1])
        self.sessions[step.session_id] = DraftSession(
            tokens=list(step.prompt_ids),
            committed=len(step.prompt_ids),
            prompt_length=len(step.prompt_ids),
            cache=cache,
            params=step.params,
            generator=self.model.new_generator(step.seed),
            coupled_seed=step.seed if step.coupled else None,
            last_used=time.monotonic(),
        )
        return time.perf_counter() - start

    def propose(self, step: Propose) -> list[draft_pb2.DraftToken]:
        """One session's proposal (a batch of one)."""
        [tokens] = self.propose_batch(ProposeBatch([step])).tokens
        if isinstance(tokens, Exception):
            raise tokens
        return tokens

    def propose_batch(self, step: ProposeBatch) -> Proposals:
        """Commits what the verifier kept of each session's last proposal, then proposes
        each one's next tokens: forward j runs one position of every session whose k
        exceeds j (more where a session catches up on tokens it missed). A session that
        fails (unknown, a bad step, an error in its own sampling) gets its exception and
        leaves the batch; the others go on."""
        results: list[list[draft_pb2.DraftToken] | Exception] = [[] for _ in step.sessions]
        proposing: list[tuple[int, DraftSession, Propose]] = []
        for i, item in enumerate(step.sessions):
            try:
                proposing.append((i, self.commit(item), item))
            except Exception as exc:
                results[i] = exc
        shapes: list[tuple[int, int]] = []
        while proposing := [(i, s, it) for i, s, it in proposing if _proposing(results[i], it.num_tokens)]:
            caches = [session.cache for _, session, _ in proposing]
            feeds = [session.tokens[session.cache.length :] for _, session, _ in proposing]
            try:
                logits = self.model.forward_batch(caches, feeds)
            except Exception as exc:
                for i, _, _ in proposing:
                    results[i] = exc
                break
            shapes.append((len(feeds), sum(len(f) for f in feeds)))
            for (i, session, _), session_logits in zip(proposing, logits):
                try:
                    results[i].append(self._choose(session, session_logits[-1]))  # type: ignore[union-attr]
                except Exception as exc:
                    results[i] = exc
        self.proposals += len(step.sessions)
        return Proposals(results, shapes)

    def commit(self, step: Propose) -> DraftSession:
        """Validates a session's step and commits what the verifier kept of its last
        proposal: the cache keeps only positions still valid."""
        session = self.sessions.get(step.session_id)
        if session is None:
            if step.session_id in self.expired:
                idle = self.expired[step.session_id]
                raise NotFound(f"draft session {step.session_id!r} expired after {idle:.1f} s without a proposal")
            raise NotFound(f"no draft session {step.session_id!r}")
        session.last_used = time.monotonic()
        proposed = len(session.tokens) - session.committed
        if step.accepted > proposed:
            raise InvalidArgument(f"accepted: {step.accepted} exceeds the {proposed} tokens proposed last round")
        if step.num_tokens < 1:
            raise InvalidArgument("num_tokens: must be at least 1")
        kept = session.committed + step.accepted
        del session.tokens[kept:]
        session.tokens.extend(step.appended_ids)
        session.committed = len(session.tokens)
        session.cache.rollback(min(session.cache.length, kept))
        if session.committed + step.num_tokens - 1 > session.cache.capacity:
            raise FailedPrecondition(
                f"{session.committed + step.num_tokens - 1} positions exceed the session's capacity of {session.cache.capacity}"
            )
        return session

    def _choose(self, session: DraftSession, logits: torch.Tensor) -> draft_pb2.DraftToken:
        """The session's next draft token from its logits at the last position."""
        position = len(session.tokens) - session.prompt_length
        noise = coupling_noise(session.coupled_seed, session.params, position, 1, logits.shape[-1])
        choice = propose_token(
            logits, session.params, self.support_size, session.generator, None if noise is None else noise[0]
        )
        session.tokens.append(choice.id)
        return draft_pb2.DraftToken(id=choice.id, support_ids=choice.support_ids, support_probs=choice.support_probs)

    def close(self, step: Close) -> bool:
        session = self.sessions.pop(step.session_id, None)
        existed = session is not None
        if session is not None:
            session.cache.release()
        if not existed and step.session_id not in self.expired:
            _remember(self.closed_unopened, step.session_id, None)
        return existed

    def expire(self, step: Expire) -> list[str]:
        """Closes the sessions idle for longer than step.idle_s; returns their ids."""
        now = time.monotonic()
        idle = [sid for sid, s in self.sessions.items() if now - s.last_used > step.idle_s]
        self.expirations += len(idle)
        for sid in idle:
            session = self.sessions.pop(sid)
            session.cache.release()
            _remember(self.expired, sid, now - session.last_used)
        return idle


def _proposing(result: list[draft_pb2.DraftToken] | Exception, num_tokens: int) -> bool:
    """Whether a session of a batch still proposes: it has not failed nor finished."""
    return not isinstance(result, Exception) and len(result) < num_tokens


def _remember(memory: OrderedDict, key: str, value: object) -> None:
    memory[key] = value
    while len(memory) > FORGET_AFTER:
        memory.popitem(last=False)
