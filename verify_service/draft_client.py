"""The verify service's side of the draft service: sessions, per-round deadlines, and
the translation of every draft failure into a target-only reason."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from specdec.serving import channel_options
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from verify_service.verifier import DraftProposal


RETRY_S = 1.0


class DraftLost(Exception):
    """The draft cannot serve this request any more; it continues target-only."""

    def __init__(self, reason: common_pb2.TargetOnlyReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, during: str) -> DraftLost:
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return cls(common_pb2.TARGET_ONLY_REASON_DRAFT_TIMED_OUT, f"draft {during} missed its deadline")
        return cls(common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE, f"draft {during} failed: {code.name}: {error.details()}")


@dataclass(frozen=True)
class DraftDeadlines:
    factor: float  # a round's deadline is this many times the expected proposal time
    floor_s: float  # and never less than this
    open_s: float  # deadline of opening a session (prefill) and of the first round


class DraftClient:
    def __init__(self, address: str, deadlines: DraftDeadlines, target_vocab_size: int) -> None:
        self.address = address
        self.deadlines = deadlines
        self._target_vocab_size = target_vocab_size
        self._channel = grpc.insecure_channel(address, options=channel_options())
        self._stub = draft_pb2_grpc.DraftStub(self._channel)
        self._lock = threading.Lock()
        self._info: draft_pb2.DraftInfo | None = None
        self._seconds_per_token: float | None = None  # moving average of observed proposals
        self._lost: DraftLost | None = None  # the last failure, answered until _retry_at
        self._retry_at = 0.0

    def info(self) -> draft_pb2.DraftInfo:
        """The draft's description, fetched once per connection; raises DraftLost.

        After a failure the draft is not asked again for RETRY_S, so that a stalled draft
        costs new requests nothing while it is down."""
        with self._lock:
            if self._info is not None:
                return self._info
            if self._lost is not None and time.monotonic() < self._retry_at:
                raise self._lost
        try:
            info = self._stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=min(self.deadlines.open_s, RETRY_S))
            if info.vocab_size != self._target_vocab_size:
                raise DraftLost(
                    common_pb2.TARGET_ONLY_REASON_DRAFT_UNAVAILABLE,
                    f"draft vocabulary has {info.vocab_size} tokens, the target's {self._target_vocab_size}",
                )
        except grpc.RpcError as error:
            self.forget(DraftLost.from_rpc(error, "info"))
            raise self._lost from None
        except DraftLost as lost:
            self.forget(lost)
            raise
        with self._lock:
            self._info = info
            if self._seconds_per_token is None:
                self._seconds_per_token = info.step_time_us * 1e-6
        return info

    def forget(self, lost: DraftLost) -> None:
        """Drops what is known of the draft after a failure; asks again after RETRY_S."""
        with self._lock:
            self._info = None
            self._lost = lost
            self._retry_at = time.monotonic() + RETRY_S

    def open(
        self, session_id: str, prompt_ids: Sequence[int], sampling: common_pb2.SamplingParams, max_tokens: int
    ) -> DraftSession:
        """Starts the draft's prefill without waiting for it (the target prefills meanwhile)."""
        request = draft_pb2.OpenSessionRequest(
            session_id=session_id, prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens
        )
        return DraftSession(self, session_id, self._stub.OpenSession.future(request, timeout=self.deadlines.open_s))

    def round_deadline_s(self, num_tokens: int) -> float:
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

    def close(self) -> None:
        self._channel.close()


class DraftSession:
    """One request's draft session. Not shared between threads."""

    def __init__(self, client: DraftClient, session_id: str, opening: grpc.Future) -> None:
        self._client = client
        self._stub = client._stub
        self.session_id = session_id
        self._opening: grpc.Future | None = opening
        self._accepted = 0
        self._appended: list[int] = []
        self._closed = False

    def propose(self, num_tokens: int) -> tuple[DraftProposal, float]:
        """The next num_tokens draft tokens and the seconds waited for them; raises DraftLost."""
        start = time.perf_counter()
        if self._opening is not None:
            try:
                self._opening.result()
            except grpc.RpcError as error:
                raise DraftLost.from_rpc(error, "prefill") from None
            self._opening = None
        request = draft_pb2.ProposeRequest(
            session_id=self.session_id, accepted=self._accepted, appended_ids=self._appended, num_tokens=num_tokens
        )
        proposing = time.perf_counter()
        try:
            response = self._stub.Propose(request, timeout=self._client.round_deadline_s(num_tokens))
        except grpc.RpcError as error:
            raise DraftLost.from_rpc(error, "proposal") from None
        end = time.perf_counter()
        self._client.observe(num_tokens, end - proposing)
        tokens = response.tokens
        proposal = DraftProposal(
            ids=[t.id for t in tokens],
            support_ids=[list(t.support_ids) for t in tokens],
            support_probs=[list(t.support_probs) for t in tokens],
        )
        return proposal, end - start

    def commit(self, accepted: int, closing_token: int) -> None:
        """Records what the verifier kept; sent with the next proposal request."""
        self._accepted = accepted
        self._appended = [closing_token]

    def close(self) -> None:
        """Frees the draft's session without waiting (the draft may be stalled or gone)."""
        if self._closed:
            return
        self._closed = True
        request = draft_pb2.CloseSessionRequest(session_id=self.session_id)
        self._stub.CloseSession.future(request, timeout=self._client.deadlines.open_s)
