"""The round loop: every active request's rounds in lockstep, on one thread.

Each step runs one round of every request that is ready, the way specdec.offline's
`speculate` runs one request's: choose each one's k, ask the draft for all proposals in one
message pair, verify them all in ONE target forward (which also carries the next chunk of
each prompt being prefilled), commit what each kept, and hand each request its chunk to
stream. Requests join at the next step and leave when they finish or their call ends, so
the batch is whatever is active, not whatever happened to be queued. Any draft failure
switches the requests it touched to target-only rounds from the next token on: the target
session already holds every committed token, so nothing is lost or repeated.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from specdec.batch_gain import choose_ks
from specdec.engine import pin_torch_threads
from specdec.errors import Internal, ServiceError, Unavailable
from specdec.v1 import common_pb2, verify_pb2
from verify_service.auto_mode import Choice, ServiceAuto
from verify_service.draft_client import DraftClient, DraftLost, ProposalLink, SessionRound
from verify_service.plan import AUTO
from verify_service.request_state import MAX_AHEAD, Request, target_only
from verify_service.round_telemetry import RoundTelemetry
from verify_service.verifier import NO_DRAFT, DraftProposal, Forwarded, Prefill, Release, Verified, Verifier, Verify

# An AUTO request that opened no draft: its rounds' choice, by why it did not
NOT_OPENED = {
    common_pb2.TARGET_ONLY_REASON_AUTO_SHORT_OUTPUT: common_pb2.AUTO_CHOICE_SHORT_OUTPUT,
    common_pb2.TARGET_ONLY_REASON_AUTO_NOT_OPENED: common_pb2.AUTO_CHOICE_NOT_OPENED,
}


@dataclass
class Totals:
    """Service-wide counters reported by GetInfo."""

    requests: int = 0
    proposed: int = 0
    accepted: int = 0
    expired: int = 0  # sessions freed because their caller stopped taking messages


@dataclass(frozen=True)
class Proposed:
    """A step's proposals: by session id, and how long the step waited for them."""

    by_session: dict[str, DraftProposal]
    wait_s: float
    compute_s: float  # the draft's own time for the batch


class RoundLoop:
    def __init__(
        self,
        verifier: Verifier,
        draft: DraftClient | None,
        auto: ServiceAuto,
        telemetry: RoundTelemetry,
        prefill_chunk: int,
        retired: Callable[[Request], None],
        log: logging.Logger,
        admitted: Callable[[], int],
    ) -> None:
        """admitted: how many requests the service holds now (opening, prefilling or decoding)."""
        self._verifier = verifier
        self._draft = draft
        self._link = ProposalLink(draft) if draft is not None else None
        self._auto = auto
        self._telemetry = telemetry
        self._prefill_chunk = prefill_chunk
        self._retired = retired  # frees what the request held outside the loop (its admission)
        self._admitted = admitted
        self._log = log
        self._eos = verifier.model.eos_token_ids
        self.totals = Totals()
        self._cond = threading.Condition()
        self._incoming: list[Request] = []
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self._woken = False
        self._stopping = False
        self._active: list[Request] = []  # in arrival order: prefill chunks go first come, first served
        self._proposing: list[Request] = []  # the requests whose proposals the step waits for
        self._planned: list[Request] | None = None  # the next step's requests, their rounds chosen
        self._asked: list[Request] = []  # those of them whose proposals were asked for
        self._previous_step: tuple[float, float] | None = None  # its start, its forward and wait
        self._thread = threading.Thread(target=self._run, name="verify-rounds", daemon=True)
        self._thread.start()

    def add(self, request: Request) -> None:
        """The request joins at the next step."""
        with self._cond:
            if self._stopping:
                raise Unavailable("the verify service is shutting down")
            self._incoming.append(request)
            self._cond.notify()

    def wake(self) -> None:
        """Something a waiting step depends on changed (a call ended, a draft prefill is done)."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    def sent(self) -> None:
        """A request's chunk left (its handler thread): a lone request's next forward may run."""
        with self._cond:
            self._cond.notify()

    def call(self, fn: Callable[[], object]) -> object:
        """Runs fn on the loop's thread between steps (calibration: the thread that runs the
        model must be the one that measures it) and returns its result."""
        future: Future = Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify()
        return future.result()

    def interrupt(self) -> None:
        """Shutdown: a step waiting on the draft stops waiting."""
        if self._link is not None:
            self._link.interrupt()

    def ended(self, request: Request) -> None:
        """A request's call ended (any thread): it leaves at the next step, and a step
        waiting on the draft for nothing but ended requests stops waiting."""
        with self._cond:
            waiting = self._proposing
            if waiting and all(r.ended.is_set() for r in waiting) and self._link is not None:
                self._link.interrupt()
            self._woken = True
            self._cond.notify()

    def stop(self) -> None:
        """Ends every request still active with UNAVAILABLE, then the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        if self._link is not None:
            self._link.close()

    # The loop.

    def _run(self) -> None:
        pin_torch_threads()
        while True:
            with self._cond:
                while not (self._incoming or self._calls or self._woken or self._stopping or self._has_work()):
                    self._previous_step = None  # an idle wait is no step's cost
                    self._cond.wait()
                incoming, self._incoming = self._incoming, []
                calls, self._calls = self._calls, []
                self._woken = False
                stopping = self._stopping
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)
            for request in incoming:
                self._join(request)
            if stopping:
                for request in list(self._active):
                    self._retire(request, Unavailable("the verify service is shutting down"))
                return
            for request in [r for r in self._active if r.ended.is_set()]:
                self._retire(request, None)
            try:
                self._step()
            except Exception as err:  # a bug: every request of the step fails, the loop goes on
                self._log.exception("a round step failed")
                for request in list(self._active):
                    self._retire(
                        request,
                        Internal(f"decoding failed: an internal error, logged under session {request.sid!r}"),
                        err,
                    )

    def _has_work(self) -> bool:
        if self._planned:
            return True
        return any(self._ready(r) or self._prefilling(r) for r in self._active if not r.ended.is_set())

    def _prefilling(self, request: Request) -> bool:
        return self._verifier.sessions[request.sid].prefill_left > 0

    def _ready(self, request: Request, emitting: bool = False) -> bool:
        """Prefilled, its draft's prefill (if it has a draft) done, and its caller keeping up
        (`emitting`: a chunk of its is about to be handed over too)."""
        return (
            not request.ended.is_set() and not self._prefilling(request)
            and (request.draft is None or request.draft.opened) and request.outbox.qsize() + emitting < MAX_AHEAD
        )  # fmt: skip

    def _join(self, request: Request) -> None:
        plan = request.plan
        step = Prefill(request.sid, plan.prompt_ids, plan.params, plan.seed, request.cache.capacity, plan.seeded)
        self._verifier.open(step, request.cache)
        self._telemetry.start_prefill(request)
        self._active.append(request)
        self.totals.requests += 1
        if not self._prefilling(request):
            self._telemetry.end_prefill(request)

    def _step(self) -> None:
        """One round of every planned request, in one target forward with the prompt chunks;
        the next step's rounds are planned and their proposals asked for before this one's
        chunks are handed over, so the draft computes while they travel."""
        if self._planned is None:
            self._plan(set(), set())
        planned, self._planned = self._planned or [], None
        step_start = time.perf_counter()
        prefill = self._prefill_chunks()
        if not planned and not prefill:
            return
        proposed = self._receive(planned)
        ready = [r for r in planned if r.sid in self._verifier.sessions and not r.ended.is_set()]
        if len(ready) == 1 and len(self._active) == 1 and not prefill:
            self._await_send(ready[0])
        for request in ready:
            request.start_planned_round()
        rounds = [Verify(r.sid, proposed.by_session.get(r.sid, NO_DRAFT)) for r in ready]
        start_ns = time.time_ns()
        forwarded = self._verifier.forward(rounds, prefill)
        end_ns = time.time_ns()
        self._observe_step(proposed, forwarded, step_start)
        committed: list[tuple[Request, Verify, verify_pb2.DecodeChunk]] = []
        for request, step, verified in zip(ready, rounds, forwarded.verified):
            if isinstance(verified, Exception):
                self._fail(request, verified)
                continue
            chunk = self._commit(request, step.draft, verified, proposed, forwarded.sessions, forwarded.positions)
            committed.append((request, step, chunk))
        self._plan({r.sid for r, _, c in committed if c.finish_reason}, {r.sid for r, _, _ in committed})
        self._telemetry.forward(forwarded.sessions, forwarded.positions)
        for request, step, chunk in committed:
            self._telemetry.verified(request, start_ns, end_ns, len(step.draft.ids) + 1, chunk.round.verify_time_us)
            self._emit(request, chunk)
        for sid in prefill:
            request = next(r for r in self._active if r.sid == sid)
            if not self._prefilling(request):
                self._telemetry.end_prefill(request)

    def _observe_step(self, proposed: Proposed, forwarded: Forwarded, step_start: float) -> None:
        """What the step cost, for the batch chooser: its forward by sessions and rows, and
        what came before it since the step before's forward (commits, spans, hand-over; the
        draft computing this step's proposals meanwhile) with its wait for them, by the
        draft's batched steps (the largest k, the sum of k)."""
        costs = self._auto.step_costs
        previous, self._previous_step = self._previous_step, None
        if costs is None or not forwarded.seconds:
            return
        costs.observe_forward(forwarded.sessions, forwarded.positions, forwarded.seconds, forwarded.context)
        if previous is not None:
            start, busy, sessions = previous
            ks = [len(p.ids) for p in proposed.by_session.values()] or [0]
            costs.observe_overhead(sessions, step_start - start - busy, max(ks), sum(ks), proposed.wait_s)
        self._previous_step = (step_start, forwarded.seconds + proposed.wait_s, forwarded.sessions)

    def _await_send(self, request: Request) -> None:
        """A lone request's forward waits until its last chunk has left: with nothing else
        to run, overlapping the two gains nothing and makes them contend for the cores (on
        the 2-core CPU, the forward's two OpenMP threads stall while the send runs). Its
        draft's proposal was asked for already and computes meanwhile. A request that
        arrives ends the wait."""
        with self._cond:
            while (request.outbox.qsize() or request.sending_since is not None) and not (
                request.ended.is_set() or self._incoming or self._stopping
            ):
                self._cond.wait()

    def _plan(self, finishing: set[str], emitting: set[str]) -> None:
        """Chooses the next round of every request that can run one and asks the draft for
        the proposals in one message (the step that runs them waits for the answer)."""
        planned = [r for r in self._active if r.sid not in finishing and self._ready(r, r.sid in emitting)]
        for request in planned:
            self._check_draft(request)
        for request, turn in zip(planned, self._choose_step(planned)):
            speculating = turn.k > 0 and request.draft is not None
            request.plan_round(turn, *self._telemetry.start_round(request, speculating))
        self._planned = planned
        speculating = [r for r in planned if r.upcoming.turn.k > 0 and r.draft is not None]
        self._asked = speculating
        if speculating:
            self._link.send([SessionRound(r.draft, r.upcoming.turn.k, r.upcoming.traceparent) for r in speculating])

    def _prefill_chunks(self) -> dict[str, int]:
        """Prompt positions each prefilling request feeds this step: the budget, first come first served."""
        budget, chunks = self._prefill_chunk, {}
        for request in self._active:
            left = self._verifier.sessions[request.sid].prefill_left
            if left and budget:
                chunks[request.sid] = min(left, budget)
                budget -= chunks[request.sid]
        return chunks

    # One request's round: choose, propose, verify (shared), commit, emit.

    def _check_draft(self, request: Request) -> None:
        """A draft session whose opening failed sends its request target-only."""
        if request.draft is not None and request.draft.opening is not None:
            try:
                prefill_s = request.draft.check_open()
            except DraftLost as lost:
                self._lose_draft(request, lost)
                return
            if prefill_s is not None and request.auto is not None:
                self._auto.observe_opening(prefill_s)

    def _choose_step(self, planned: list[Request]) -> list[Choice]:
        """Every planned round's k: each request's own choice, then, for the AUTO sessions
        whose own gain is worth speculating (BEST_K), the batch chooser's k with the whole
        step in view (the others' k and the prompt chunks count as rows of the forward)."""
        turns = [self._choose(request) for request in planned]
        chosen = [i for i, turn in enumerate(turns) if turn.how == common_pb2.AUTO_CHOICE_BEST_K]
        costs = self._auto.step_costs
        chunk_rows = sum(self._prefill_chunks().values())
        if not chosen or costs is None or (len(planned) == 1 and not chunk_rows):
            return turns  # alone, a session's own choice is the chooser's (with its pause margin)
        k_max = self._auto.policy.k_max
        lengths = [s.cache.length for r in planned if (s := self._verifier.sessions.get(r.sid)) is not None]
        context = statistics.fmean(lengths) if lengths else None
        step = costs.step_costs(len(planned), k_max, chunk_rows, context)
        if step is None:  # the draft's batched cost is not known yet: each session's own k
            return turns
        caps = [turn.k for turn in turns]
        for i in chosen:
            caps[i] = min(k_max, planned[i].remaining - 1)
        floors = [0 if i in chosen else turn.k for i, turn in enumerate(turns)]
        alphas = [turn.alpha or self._auto.prior_alpha(r.plan.params.greedy) for r, turn in zip(planned, turns)]
        ks, goodput = choose_ks(alphas, step, k_max, caps, floors)
        for i in chosen:
            how = common_pb2.AUTO_CHOICE_BEST_K if ks[i] else common_pb2.AUTO_CHOICE_LOAD
            turns[i] = replace(turns[i], k=ks[i], how=how, predicted_tokens_per_s=goodput)
        return turns

    def _choose(self, request: Request) -> Choice:
        """What the round does: its k never proposes past the last position the request
        may emit (so the last round is target-only)."""
        plan = request.plan
        if request.draft is None:
            how = NOT_OPENED.get(request.speculation.reason, common_pb2.AUTO_CHOICE_UNSPECIFIED)
            return Choice(0, how, 0.0, 0.0)
        if request.auto is not None:
            scheduled = self._auto.policy.scheduled_k(len(self._active))
            if scheduled is None:
                choice = request.auto.next()
            else:
                choice = Choice(scheduled, common_pb2.AUTO_CHOICE_SCHEDULE, 0.0, request.auto.alpha)
        else:
            choice = Choice(plan.num_draft_tokens, common_pb2.AUTO_CHOICE_UNSPECIFIED, 0.0, 0.0)
        return replace(choice, k=min(choice.k, request.remaining - 1))

    def _receive(self, planned: list[Request]) -> Proposed:
        """The proposals `_plan` asked for, by session id (the requests the draft failed go
        target-only), and how long this step waited for them."""
        asked, self._asked = self._asked, []
        if not asked:
            return Proposed({}, 0.0, 0.0)
        start = time.perf_counter()
        with self._cond:
            self._proposing = asked
        try:
            if all(r.ended.is_set() for r in asked):
                self._link.interrupt()
            results, compute_s = self._link.receive()
        except DraftLost as lost:
            for request in asked:
                if request.draft is not None:
                    self._lose_draft(request, lost)
            return Proposed({}, time.perf_counter() - start, 0.0)
        finally:
            with self._cond:
                self._proposing = []
        wait_s = time.perf_counter() - start
        by_session = {}
        for request, result in zip(asked, results):
            if request.draft is None:  # retired meanwhile
                continue
            if isinstance(result, DraftLost):
                self._lose_draft(request, result)
            else:
                by_session[request.sid] = result
        return Proposed(by_session, wait_s, compute_s)

    def _lose_draft(self, request: Request, lost: DraftLost) -> None:
        """The request goes on target-only; the pairing goes too if the draft is in doubt."""
        if lost.unpairs:
            self._draft.forget(lost)
        request.draft.close()
        request.draft = None
        request.speculation = target_only(lost.reason, str(lost))

    def _commit(
        self,
        request: Request,
        proposal: DraftProposal,
        verified: Verified,
        proposed: Proposed,
        sessions: int,
        positions: int,
    ) -> verify_pb2.DecodeChunk:
        """What the round kept: told to the draft, counted, and made the chunk to stream."""
        turn = request.turn
        if request.draft is not None and proposal.ids:
            request.draft.commit(verified.accepted, verified.tokens[-1])
        elif request.draft is not None:  # a target-only round: the draft learns its token with the next request
            request.draft.append(verified.tokens)
        tokens, finish = self._cut(verified.tokens, request.remaining)
        speculated = bool(proposal.ids)
        stats = common_pb2.RoundStats(
            index=request.index,
            draft_tokens=len(proposal.ids),
            accepted_tokens=verified.accepted,
            closing=(
                common_pb2.CLOSING_TOKEN_BONUS
                if verified.accepted == len(proposal.ids)
                else common_pb2.CLOSING_TOKEN_CORRECTION
            ),
            draft_time_us=int(proposed.wait_s * 1e6) if speculated else 0,
            verify_time_us=int(verified.seconds * 1e6),
            draft_compute_us=int(proposed.compute_s * 1e6) if speculated else 0,
            mode=request.plan.mode,
            auto_choice=turn.how,
            expected_gain=turn.gain,
            alpha_estimate=turn.alpha,
            batch_sessions=sessions,
            batch_positions=positions,
            predicted_tokens_per_s=turn.predicted_tokens_per_s,
        )
        request.usage.add(stats, len(tokens))
        request.load.add(stats, request.plan.mode == AUTO)
        self.totals.proposed += stats.draft_tokens
        self.totals.accepted += stats.accepted_tokens
        self._observe(request, stats, len(tokens))
        shown = request.speculation
        if turn.how == common_pb2.AUTO_CHOICE_LOW_GAIN and shown.speculating:
            detail = f"AUTO: the best expected gain is {turn.gain:.2f}x at α̂ {turn.alpha:.2f}; target-only until the next probe"
            shown = target_only(common_pb2.TARGET_ONLY_REASON_AUTO_LOW_GAIN, detail)
        chunk = verify_pb2.DecodeChunk(token_ids=tokens, round=stats, speculation=shown)
        if finish:
            chunk.finish_reason = finish
            chunk.usage.CopyFrom(request.usage.to_proto())
        return chunk

    def _observe(self, request: Request, stats: common_pb2.RoundStats, emitted: int) -> None:
        """AUTO's bookkeeping: the session's α̂ and pause, the service's α̂ and costs."""
        if request.auto is not None:
            request.auto.observe(stats.draft_tokens, stats.accepted_tokens, emitted)
        if stats.draft_tokens:
            greedy = request.plan.params.greedy
            self._auto.observe_alpha(greedy, stats.accepted_tokens, stats.accepted_tokens < stats.draft_tokens)
        if request.auto is not None and stats.draft_tokens and request.usage.proposed == stats.draft_tokens:
            # the session's first speculative round: what it waited beyond a steady one is the opening's
            self._auto.observe_first_round(stats.draft_tokens, stats.draft_time_us / 1e6, request.plan.params.greedy)
        if self._steady(request):
            period = time.perf_counter() - request.round_start
            # Alone: the only request in the service. A round alone in its step while others
            # open their draft sessions or prefill waits on their work too, and measured so
            # under load it priced a k = 4 round at 5 target-only rounds and paused sessions.
            alone = stats.batch_sessions == 1 and self._admitted() == 1
            self._auto.observe(
                request.plan.params.greedy, alone, stats.draft_tokens,
                stats.draft_time_us / 1e6, stats.verify_time_us / 1e6, period,
            )  # fmt: skip

    @staticmethod
    def _steady(request: Request) -> bool:
        """Whether a round's costs are a steady sample: not the first round (it also waits
        for the draft's prefill), nor a probe after a target-only stretch (the draft first
        catches up on the tokens it missed)."""
        previous, turn = request.previous, request.turn
        after_pause = previous is not None and previous.how == common_pb2.AUTO_CHOICE_LOW_GAIN
        return request.index > 0 and not (turn.how == common_pb2.AUTO_CHOICE_PROBE and after_pause)

    def _emit(self, request: Request, chunk: verify_pb2.DecodeChunk) -> None:
        self._telemetry.end_round(request, chunk)
        request.previous, request.index = request.turn, request.index + 1
        if chunk.finish_reason:
            self._retire(request, chunk)
        else:
            request.outbox.put(chunk)

    def _cut(self, tokens: list[int], remaining: int) -> tuple[list[int], common_pb2.FinishReason]:
        """The round's tokens up to the first EOS or the length limit, and why it ended."""
        for i, token in enumerate(tokens[:remaining]):
            if token in self._eos:
                return tokens[: i + 1], common_pb2.FINISH_REASON_EOS
        if len(tokens) >= remaining:
            return tokens[:remaining], common_pb2.FINISH_REASON_LENGTH
        return tokens, common_pb2.FINISH_REASON_UNSPECIFIED

    def _fail(self, request: Request, err: Exception) -> None:
        """One request's round could not run: that request alone fails."""
        if isinstance(err, ServiceError):
            self._retire(request, err, err)
            return
        self._log.error("session %r failed", request.sid, exc_info=err)
        self._retire(
            request, Internal(f"decoding failed: an internal error, logged under session {request.sid!r}"), err
        )

    def _retire(self, request: Request, last: object, cause: BaseException | None = None) -> None:
        """Frees the request's sessions and reservation, then hands it its last message
        (its final chunk or the error that ends it; None when its call already ended), so
        that a client that has its completion never sees the request as active."""
        if cause is not None:
            self._telemetry.fail(request, cause)
        else:
            self._telemetry.close(request)
        self._active.remove(request)
        self._verifier.release(Release(request.sid))
        if request.draft is not None:
            request.draft.close()
            request.draft = None
        self._retired(request)
        if last is not None:
            request.outbox.put(last)
