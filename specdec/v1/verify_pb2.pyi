from specdec.v1 import common_pb2 as _common_pb2
from specdec.v1 import pairing_pb2 as _pairing_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "max_new_tokens", "sampling", "speculation", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationMode
    num_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationMode, str]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "round", "speculation", "finish_reason", "usage")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    round: _common_pb2.RoundStats
    speculation: _common_pb2.Speculation
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., round: _Optional[_Union[_common_pb2.RoundStats, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.Speculation, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class VerifyInfoRequest(_message.Message):
    __slots__ = ("recent_requests",)
    RECENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    recent_requests: int
    def __init__(self, recent_requests: _Optional[int] = ...) -> None: ...

class RecentRequests(_message.Message):
    __slots__ = ("window", "requests", "mean_completion_tokens", "speculated_requests", "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate", "rejections", "alpha_hat", "load_bands")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MEAN_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    ALPHA_HAT_FIELD_NUMBER: _ClassVar[int]
    LOAD_BANDS_FIELD_NUMBER: _ClassVar[int]
    window: int
    requests: int
    mean_completion_tokens: float
    speculated_requests: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    acceptance_rate: float
    rejections: int
    alpha_hat: float
    load_bands: _containers.RepeatedCompositeFieldContainer[LoadBand]
    def __init__(self, window: _Optional[int] = ..., requests: _Optional[int] = ..., mean_completion_tokens: _Optional[float] = ..., speculated_requests: _Optional[int] = ..., draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., rejections: _Optional[int] = ..., alpha_hat: _Optional[float] = ..., load_bands: _Optional[_Iterable[_Union[LoadBand, _Mapping]]] = ...) -> None: ...

class LoadBand(_message.Message):
    __slots__ = ("min_sessions", "max_sessions", "auto_rounds", "held_by_load", "draft_tokens_proposed", "draft_tokens_accepted", "rejections", "alpha_hat")
    MIN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    AUTO_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_LOAD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    ALPHA_HAT_FIELD_NUMBER: _ClassVar[int]
    min_sessions: int
    max_sessions: int
    auto_rounds: int
    held_by_load: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    rejections: int
    alpha_hat: float
    def __init__(self, min_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., auto_rounds: _Optional[int] = ..., held_by_load: _Optional[int] = ..., draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., rejections: _Optional[int] = ..., alpha_hat: _Optional[float] = ...) -> None: ...

class VerifyInfo(_message.Message):
    __slots__ = ("model", "parameters", "vocab_size", "max_positions", "device", "draft_address", "max_new_tokens_limit", "active_sessions", "requests", "rounds", "target_forwards", "prefills", "draft_tokens_proposed", "draft_tokens_accepted", "runtime", "pairing", "max_sessions", "recent", "queued_requests", "max_queued", "session_kv_budget_bytes", "session_idle_s", "expired_sessions", "kv_pool", "runtime_detail", "prefill_chunk_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    PAIRING_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    SESSION_KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_DETAIL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    parameters: int
    vocab_size: int
    max_positions: int
    device: str
    draft_address: str
    max_new_tokens_limit: int
    active_sessions: int
    requests: int
    rounds: int
    target_forwards: int
    prefills: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    runtime: str
    pairing: _pairing_pb2.Pairing
    max_sessions: int
    recent: RecentRequests
    queued_requests: int
    max_queued: int
    session_kv_budget_bytes: int
    session_idle_s: float
    expired_sessions: int
    kv_pool: _common_pb2.KVPoolInfo
    runtime_detail: str
    prefill_chunk_tokens: int
    def __init__(self, model: _Optional[str] = ..., parameters: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_positions: _Optional[int] = ..., device: _Optional[str] = ..., draft_address: _Optional[str] = ..., max_new_tokens_limit: _Optional[int] = ..., active_sessions: _Optional[int] = ..., requests: _Optional[int] = ..., rounds: _Optional[int] = ..., target_forwards: _Optional[int] = ..., prefills: _Optional[int] = ..., draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., runtime: _Optional[str] = ..., pairing: _Optional[_Union[_pairing_pb2.Pairing, _Mapping]] = ..., max_sessions: _Optional[int] = ..., recent: _Optional[_Union[RecentRequests, _Mapping]] = ..., queued_requests: _Optional[int] = ..., max_queued: _Optional[int] = ..., session_kv_budget_bytes: _Optional[int] = ..., session_idle_s: _Optional[float] = ..., expired_sessions: _Optional[int] = ..., kv_pool: _Optional[_Union[_common_pb2.KVPoolInfo, _Mapping]] = ..., runtime_detail: _Optional[str] = ..., prefill_chunk_tokens: _Optional[int] = ...) -> None: ...
