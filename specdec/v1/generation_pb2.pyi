from specdec.v1 import common_pb2 as _common_pb2
from specdec.v1 import verify_pb2 as _verify_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculationSettings(_message.Message):
    __slots__ = ("mode", "num_draft_tokens")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2.SpeculationMode
    num_draft_tokens: int
    def __init__(self, mode: _Optional[_Union[_common_pb2.SpeculationMode, str]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "speculation")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationSettings
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationSettings, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "round", "speculation", "finish_reason", "usage", "trace_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    round: _common_pb2.RoundStats
    speculation: _common_pb2.Speculation
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    trace_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., round: _Optional[_Union[_common_pb2.RoundStats, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.Speculation, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...

class GatewayInfoRequest(_message.Message):
    __slots__ = ("recent_requests",)
    RECENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    recent_requests: int
    def __init__(self, recent_requests: _Optional[int] = ...) -> None: ...

class GatewayInfo(_message.Message):
    __slots__ = ("verify_address", "tokenizer", "verify", "active_streams")
    VERIFY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    verify_address: str
    tokenizer: str
    verify: _verify_pb2.VerifyInfo
    active_streams: int
    def __init__(self, verify_address: _Optional[str] = ..., tokenizer: _Optional[str] = ..., verify: _Optional[_Union[_verify_pb2.VerifyInfo, _Mapping]] = ..., active_streams: _Optional[int] = ...) -> None: ...
