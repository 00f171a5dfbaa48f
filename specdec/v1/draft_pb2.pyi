from specdec.v1 import common_pb2 as _common_pb2
from specdec.v1 import pairing_pb2 as _pairing_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "max_tokens", "pairing_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAIRING_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    pairing_id: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., pairing_id: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("prefill_time_us",)
    PREFILL_TIME_US_FIELD_NUMBER: _ClassVar[int]
    prefill_time_us: int
    def __init__(self, prefill_time_us: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "accepted", "appended_ids", "num_tokens", "traceparent")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    APPENDED_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    accepted: int
    appended_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    traceparent: str
    def __init__(self, session_id: _Optional[str] = ..., accepted: _Optional[int] = ..., appended_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class DraftToken(_message.Message):
    __slots__ = ("id", "support_ids", "support_probs")
    ID_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_PROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    support_ids: _containers.RepeatedScalarFieldContainer[int]
    support_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, id: _Optional[int] = ..., support_ids: _Optional[_Iterable[int]] = ..., support_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeBatchRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    def __init__(self, sessions: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ...) -> None: ...

class SessionProposal(_message.Message):
    __slots__ = ("session_id", "tokens", "status", "detail")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[DraftToken]
    status: int
    detail: str
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[DraftToken, _Mapping]]] = ..., status: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ProposeBatchResponse(_message.Message):
    __slots__ = ("sessions", "compute_time_us", "forwards")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TIME_US_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionProposal]
    compute_time_us: int
    forwards: int
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionProposal, _Mapping]]] = ..., compute_time_us: _Optional[int] = ..., forwards: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model", "parameters", "vocab_size", "max_positions", "device", "support_size", "step_time_us", "active_sessions", "forwards", "proposals", "runtime", "max_sessions", "session_idle_s", "expired_sessions", "kv_pool", "runtime_detail")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_US_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_DETAIL_FIELD_NUMBER: _ClassVar[int]
    model: str
    parameters: int
    vocab_size: int
    max_positions: int
    device: str
    support_size: int
    step_time_us: int
    active_sessions: int
    forwards: int
    proposals: int
    runtime: str
    max_sessions: int
    session_idle_s: float
    expired_sessions: int
    kv_pool: _common_pb2.KVPoolInfo
    runtime_detail: str
    def __init__(self, model: _Optional[str] = ..., parameters: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_positions: _Optional[int] = ..., device: _Optional[str] = ..., support_size: _Optional[int] = ..., step_time_us: _Optional[int] = ..., active_sessions: _Optional[int] = ..., forwards: _Optional[int] = ..., proposals: _Optional[int] = ..., runtime: _Optional[str] = ..., max_sessions: _Optional[int] = ..., session_idle_s: _Optional[float] = ..., expired_sessions: _Optional[int] = ..., kv_pool: _Optional[_Union[_common_pb2.KVPoolInfo, _Mapping]] = ..., runtime_detail: _Optional[str] = ...) -> None: ...
