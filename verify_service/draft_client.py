"""The verify service's side of the draft service: the pairing handshake, sessions,
per-round deadlines, and the translation of every draft failure or refusal into a
target-only reason."""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from specdec.pairing import (
    REFUSAL_FACTS_KEY,
    PairingPolicy,
    base_record,
    decide,
    describe_refused_draft,
    transport_of_address,
)
from specdec.serving import channel_options
from specdec.telemetry import Metadata
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, pairing_pb2
from verify_service.verifier import DraftProposal

RETRY_S = 1.0
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


# Answers that put the draft itself in doubt: it does not answer, or no longer knows this
# verify service's pairing (it restarted). Any other answer is about one session (it
# expired, the draft is at capacity, this request cancelled its own call, one session's
# step failed): the pairing stands and other requests keep speculating.
UNPAIRING_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)


class DraftLost(Exception):
    """The draft cannot serve this request any more; it continues target-only.
    `unpairs`: the draft itself is in doubt (down, stalled, restarted), so the pairing is
    dropped and the handshake runs again before the next session."""

    def __init__(self, reason: common_pb2.TargetOnlyReason, detail: str, unpairs: bool = True) -> None:
        super().__init__(detail)
        self.reason = reason
        self.unpairs = unpairs

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, during: str) -> DraftLost:
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return cls(common_pb2.TARGET_ONLY_REASON_DRAFT_TIMED_OUT, f"draft {during} missed its deadline")
        detail = f"draft {during} failed: {code.name}"
        if code != grpc.StatusCode.UNKNOWN:  # UNKNOWN carries an exception's own text, not one written for clients
            detail += f": {error.details()}"
        return cls(common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE, detail, unpairs=code in UNPAIRING_CODES)

    @classmethod
    def cancelled(cls, during: str) -> DraftLost:
        """This request cancelled its own draft call (it ended): the pairing stands."""
        return cls(common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE, f"draft {during} cancelled", unpairs=False)


class Watchdog:
    """Cancels proposal streams whose round deadline passed: one thread for every session
    (a timer per round would start a thread per round). It sleeps until the earliest
    deadline armed, and is woken only by one that is earlier still."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Callable[[], None]]] = {}  # alarm -> (monotonic deadline, expire)
        self._wake_at = math.inf
        self._alarms = itertools.count()
        threading.Thread(target=self._loop, name="draft-deadlines", daemon=True).start()

    def arm(self, timeout_s: float, expire: Callable[[], None]) -> int:
        at = time.monotonic() + timeout_s
        with self._cond:
            alarm = next(self._alarms)
            self._armed[alarm] = (at, expire)
            if at < self._wake_at:
                self._cond.notify()
        return alarm

    def disarm(self, alarm: int) -> None:
        with self._cond:
            self._armed.pop(alarm, None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [alarm for alarm, (at, _) in self._armed.items() if at <= now]
                expired = [self._armed.pop(alarm)[1] for alarm in due]
                self._wake_at = min((at for at, _ in self._armed.values()), default=math.inf)
                if not expired:
                    self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)
                    continue
            for expire in expired:
                expire()


@dataclass(frozen=True)
class DraftDeadlines:
    factor: float  # a round's deadline is this many times the expected proposal time
    floor_s: float  # and never less than this
    open_s: float  # deadline of opening a session (prefill) and of the first round


class DraftClient:
    """Pairs with the draft service before sending it any session, and re-pairs after
    the draft was lost. Thread-safe: every request's handler thread shares it."""

    def __init__(
        self,
        address: str,
        deadlines: DraftDeadlines,
        own_facts: Callable[[], pairing_pb2.PeerFacts],
        policy: PairingPolicy,
        log: logging.Logger,
    ) -> None:
        self.address = address
        self.deadlines = deadlines
        self._own_facts = own_facts
        self._policy = policy
        self._log = log
        self._transport = transport_of_address(address)
        self._channel = grpc.insecure_channel(address, options=channel_options())
        self._stub = draft_pb2_grpc.DraftStub(self._channel)
        self._lock = threading.Lock()
        self._pairing = pairing_pb2.Pairing(state=pairing_pb2.PAIRING_STATE_UNSPECIFIED, transport=self._transport)
        self._pairing_id = ""  # set while paired
        self._seconds_per_token: float | None = None  # moving average of observed proposals
        self._lost: DraftLost | None = None  # the last failure or refusal, answered until _retry_at
        self._retry_at = 0.0
        self._unawaited: set[grpc.Future] = set()  # calls sent without waiting, held until done
        self.watchdog = Watchdog()

    @property
    def pairing_id(self) -> str:
        """The pairing's id while paired, else ''."""
        with self._lock:
            return self._pairing_id

    @property
    def pairing(self) -> pairing_pb2.Pairing:
        with self._lock:
            return pairing_pb2.Pairing.FromString(self._pairing.SerializeToString())

    def attach(self, now: bool = False, wait_s: float = 0.0) -> pairing_pb2.Pairing:
        """The pairing record of a paired draft, running the handshake when there is none;
        raises DraftLost when the draft is refused or unreachable.

        After a failure or a refusal the handshake is not tried again for RETRY_S (unless
        `now`), so that a draft that is down or refused costs new requests nothing.
        `wait_s` > 0 waits that long for a draft that is not listening yet (at startup)."""
        with self._lock:
            if self._pairing_id:
                return self._pairing
            if not now and self._lost is not None and time.monotonic() < self._retry_at:
                raise self._lost
        own = self._own_facts()
        request = pairing_pb2.PairRequest(
            verifier=own, allow_different_tokenizer=self._policy.allow_different_tokenizer
        )
        timeout_s = wait_s if wait_s > 0 else min(self.deadlines.open_s, RETRY_S)
        try:
            response = self._stub.Pair(request, timeout=timeout_s, wait_for_ready=wait_s > 0)
        except grpc.RpcError as error:
            record = base_record(self._transport, own)
            record.status = error.code().name
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                record.state = pairing_pb2.PAIRING_STATE_REFUSED
                record.detail = f"the draft service refused to pair: {error.details()}"
                for key, value in error.trailing_metadata() or ():
                    if key == REFUSAL_FACTS_KEY:
                        describe_refused_draft(record, own, pairing_pb2.PeerFacts.FromString(value))
                lost = DraftLost(common_pb2.TARGET_ONLY_REASON_DRAFT_REFUSED, record.detail)
            else:
                record.state = pairing_pb2.PAIRING_STATE_UNREACHABLE
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Not a round's deadline (DRAFT_TIMED_OUT): nothing answered at all,
                    # which is what a draft that is not listening looks like while waited for.
                    detail = f"no draft service answered the pairing handshake at {self.address} within {timeout_s:g} s"
                    lost = DraftLost(common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE, detail)
                else:
                    lost = DraftLost.from_rpc(error, "pairing handshake")
                record.detail = str(lost)
            self._settle(record, "", lost)
            raise lost from None
        record = decide(self._transport, own, response.draft, self._policy)
        if record.state != pairing_pb2.PAIRING_STATE_PAIRED:
            lost = DraftLost(common_pb2.TARGET_ONLY_REASON_DRAFT_REFUSED, f"draft refused: {record.detail}")
            self._settle(record, "", lost)
            raise lost
        self._settle(record, response.pairing_id, None)
        with self._lock:
            if self._seconds_per_token is None:
                self._seconds_per_token = response.step_time_us * 1e-6
        return record

    def _settle(self, record: pairing_pb2.Pairing, pairing_id: str, lost: DraftLost | None) -> None:
        """Stores the handshake's outcome; logs it when it changed."""
        with self._lock:
            changed = (record.state, record.detail, list(record.warnings)) != (
                self._pairing.state, self._pairing.detail, list(self._pairing.warnings),
            )  # fmt: skip
            self._pairing, self._pairing_id, self._lost = record, pairing_id, lost
            if lost is not None:
                self._retry_at = time.monotonic() + RETRY_S
        if not changed:
            return
        if record.state == pairing_pb2.PAIRING_STATE_PAIRED:
            self._log.info(
                "paired with the draft at %s: %s, link %s (%s), target memory share %.1f%%, tokenizers %s%s%s",
                self.address, record.draft_host, pairing_pb2.GpuLink.Name(record.link), record.link_detail,
                record.target_memory_share * 100, "match" if record.tokenizer_match else "DIFFER",
                f", overrides: {', '.join(record.overrides)}" if record.overrides else "",
                f", warnings: {'; '.join(record.warnings)}" if record.warnings else "",
            )  # fmt: skip
        else:
            self._log.warning(
                "draft at %s %s: %s", self.address, pairing_pb2.PairingState.Name(record.state), record.detail
            )

    def forget(self, lost: DraftLost) -> None:
        """Drops the pairing after a failure; the handshake runs again after RETRY_S."""
        with self._lock:
            record = pairing_pb2.Pairing.FromString(self._pairing.SerializeToString())
        record.state = pairing_pb2.PAIRING_STATE_UNREACHABLE
        record.status = "UNAVAILABLE"
        record.detail = str(lost)
        self._settle(record, "", lost)

    def open(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: common_pb2.SamplingParams,
        max_tokens: int,
        metadata: Metadata,
        on_done: Callable[[], None],
    ) -> DraftSession:
        """Starts the draft's prefill without waiting for it (the target prefills meanwhile);
        metadata carries the request's trace context; on_done runs when it completed."""
        with self._lock:
            pairing_id = self._pairing_id
        request = draft_pb2.OpenSessionRequest(
            session_id=session_id, prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
            pairing_id=pairing_id,
        )  # fmt: skip
        session = DraftSession(self, session_id)
        session.opening = self._stub.OpenSession.future(request, timeout=self.deadlines.open_s, metadata=metadata)
        session.opening.add_done_callback(lambda _: on_done())
        return session

    def round_deadline_s(self, num_tokens: int) -> float:
        """Seconds a step's proposal of num_tokens draft forwards may take."""
        with self._lock:
            per_token = self._seconds_per_token
        if per_token is None:
            return self.deadlines.open_s
        return max(self.deadlines.floor_s, self.deadlines.factor * num_tokens * per_token)

    def observe(self, num_tokens: int, seconds: float) -> None:
        with self._lock:
            sample = seconds / num_tokens
            old = self._seconds_per_token
            self._seconds_per_token = sample if old is None else 0.9 * old + 0.1 * sample

    def keep_until_done(self, call: grpc.Future) -> None:
        """Holds a call nobody waits for until it completes: grpc cancels a call whose
        future is garbage-collected, which would leave its session open on the draft."""
        with self._lock:
            self._unawaited.add(call)
        call.add_done_callback(self._forget_call)

    def _forget_call(self, call: grpc.Future) -> None:
        with self._lock:
            self._unawaited.discard(call)

    def close(self) -> None:
        self._channel.close()


@dataclass(frozen=True)
class SessionRound:
    """One session's part of a step's batch proposal."""

    session: DraftSession
    num_tokens: int  # k
    traceparent: str  # W3C traceparent of the session's round span (the draft's span's parent)


class ProposalLink:
    """The one ProposeBatch stream to the draft: a message pair per step carries every
    speculating session's round, sent (`send`) before the step that uses it and waited for
    (`receive`) when it starts. Used by the verify service's round thread only (but
    `interrupt` may come from any thread). A stream that failed or missed a step's
    deadline is dropped; the next step opens a new one."""

    def __init__(self, client: DraftClient) -> None:
        self._client = client
        self._requests: queue.SimpleQueue[draft_pb2.ProposeBatchRequest | None] | None = None
        self._stream: Any = None
        self._pairing_id = ""  # of the pairing the stream was opened under
        self._steps = 0  # draft forwards the request in flight takes
        self._sent: Sequence[SessionRound] = ()
        self._sent_at = 0.0
        self._alarm: int | None = None
        self._timed_out = False  # the step's deadline passed
        self._interrupted = False  # the caller stopped waiting (its requests ended, shutdown)

    def send(self, rounds: Sequence[SessionRound]) -> None:
        """Asks for every session's next proposal without waiting (`receive` waits)."""
        pairing_id = self._client.pairing_id
        if self._stream is not None and pairing_id != self._pairing_id:
            self._drop()  # a stream of an earlier pairing: the draft it reached may be gone
        if self._stream is None:
            self._pairing_id = pairing_id
            self._requests = queue.SimpleQueue()
            self._stream = self._client._stub.ProposeBatch(iter(self._requests.get, None))
            self._timed_out = self._interrupted = False
        request = draft_pb2.ProposeBatchRequest(
            sessions=[r.session.next_request(r.num_tokens, r.traceparent) for r in rounds]
        )
        # A session catching up after target-only rounds feeds the tokens it missed first:
        # one more forward, longer than a step, allowed for as if a step each.
        self._steps = max(r.num_tokens + r.session.catch_up for r in rounds)
        self._sent = rounds
        self._sent_at = time.perf_counter()
        self._requests.put(request)
        self._alarm = self._client.watchdog.arm(self._client.round_deadline_s(self._steps), self._expire)

    def receive(self) -> tuple[list[DraftProposal | DraftLost], float]:
        """Every session's proposal asked for by `send` (or why that session lost its draft)
        and the draft's own compute seconds for the batch; raises DraftLost when the draft
        failed them all."""
        try:
            response = next(self._stream)
        except StopIteration:
            self._drop()
            raise DraftLost(
                common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE, "draft proposal stream ended early"
            ) from None
        except grpc.RpcError as error:
            timed_out, interrupted = self._timed_out, self._interrupted
            self._drop()
            if timed_out:
                raise DraftLost(
                    common_pb2.TARGET_ONLY_REASON_DRAFT_TIMED_OUT, "draft proposal missed its deadline"
                ) from None
            if interrupted:
                raise DraftLost.cancelled("proposal") from None
            raise DraftLost.from_rpc(error, "proposal") from None
        finally:
            self._client.watchdog.disarm(self._alarm)
        self._client.observe(self._steps, time.perf_counter() - self._sent_at)
        results: list[DraftProposal | DraftLost] = []
        for answer in response.sessions:
            if answer.status:
                detail = f"draft proposal failed: {_STATUS[answer.status].name}: {answer.detail}"
                results.append(DraftLost(common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE, detail, unpairs=False))
                continue
            tokens = answer.tokens
            results.append(
                DraftProposal(
                    ids=[t.id for t in tokens],
                    support_ids=[list(t.support_ids) for t in tokens],
                    support_probs=[list(t.support_probs) for t in tokens],
                )
            )
        return results, response.compute_time_us / 1e6

    def _expire(self) -> None:
        """A step's deadline passed (the watchdog's thread)."""
        self._timed_out = True
        self._cancel()

    def interrupt(self) -> None:
        """Stops waiting on the draft: the requests waiting ended, or the service shuts
        down. The pairing stands."""
        self._interrupted = True
        self._cancel()

    def _cancel(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def _drop(self) -> None:
        if self._requests is not None:
            self._requests.put(None)
        if self._stream is not None:
            self._stream.cancel()
        self._stream = self._requests = None

    def close(self) -> None:
        self._drop()


class DraftSession:
    """One request's draft session: its OpenSession call, what the verifier kept since the
    last proposal, and its CloseSession. Its rounds travel in the ProposalLink's batches."""

    def __init__(self, client: DraftClient, session_id: str) -> None:
        self._client = client
        self._stub = client._stub
        self.session_id = session_id
        self.opening: grpc.Future | None = None  # the OpenSession call, until it completed
        self._accepted = 0
        self._appended: list[int] = []
        self._closed = False

    @property
    def opened(self) -> bool:
        """The draft's prefill is done (or failed: `check_open` says)."""
        return self.opening is None or self.opening.done()

    def check_open(self) -> float | None:
        """Raises DraftLost when the session's OpenSession failed; call once `opened`. The
        draft's prefill seconds the first time it is seen done, else None."""
        if self.opening is None:
            return None
        try:
            return self.opening.result().prefill_time_us / 1e6
        except grpc.FutureCancelledError:
            raise DraftLost.cancelled("prefill") from None
        except grpc.RpcError as error:
            raise DraftLost.from_rpc(error, "prefill") from None
        finally:
            if self.opening.done():
                self.opening = None

    @property
    def catch_up(self) -> int:
        """Extra draft forwards the next proposal takes for tokens the draft missed."""
        return max(0, len(self._appended) - 1)

    def next_request(self, num_tokens: int, traceparent: str) -> draft_pb2.ProposeRequest:
        """The session's part of the next batch: what was kept, then k more."""
        request = draft_pb2.ProposeRequest(
            session_id=self.session_id, accepted=self._accepted, appended_ids=self._appended, num_tokens=num_tokens,
            traceparent=traceparent,
        )  # fmt: skip
        self._accepted, self._appended = 0, []
        return request

    def commit(self, accepted: int, closing_token: int) -> None:
        """Records what the verifier kept of the last proposal; sent with the next request."""
        self._accepted = accepted
        self._appended = [closing_token]

    def append(self, tokens: list[int]) -> None:
        """Records tokens of target-only rounds; sent with the next request."""
        self._appended.extend(tokens)

    def close(self) -> None:
        """Frees the draft's session without waiting (the draft may be stalled or gone)."""
        if self._closed:
            return
        self._closed = True
        opening, self.opening = self.opening, None
        if opening is None or opening.done():
            self._send_close()
        else:  # a request that ended before its first proposal: close after the open, not before
            self._client.keep_until_done(opening)
            opening.add_done_callback(lambda _: self._send_close())

    def _send_close(self) -> None:
        request = draft_pb2.CloseSessionRequest(session_id=self.session_id)
        self._client.keep_until_done(self._stub.CloseSession.future(request, timeout=self._client.deadlines.open_s))
