from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_ON: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_AUTO: _ClassVar[SpeculationMode]

class TargetOnlyReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TARGET_ONLY_REASON_UNSPECIFIED: _ClassVar[TargetOnlyReason]
    TARGET_ONLY_REASON_OFF_BY_REQUEST: _ClassVar[TargetOnlyReason]
    TARGET_ONLY_REASON_DRAFT_UNAVAILABLE: _ClassVar[TargetOnlyReason]
    TARGET_ONLY_REASON_DRAFT_TIMED_OUT: _ClassVar[TargetOnlyReason]
    TARGET_ONLY_REASON_DRAFT_REFUSED: _ClassVar[TargetOnlyReason]
    TARGET_ONLY_REASON_AUTO_SHORT_OUTPUT: _ClassVar[TargetOnlyReason]
    TARGET_ONLY_REASON_AUTO_LOW_GAIN: _ClassVar[TargetOnlyReason]
    TARGET_ONLY_REASON_AUTO_NOT_OPENED: _ClassVar[TargetOnlyReason]

class AutoChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUTO_CHOICE_UNSPECIFIED: _ClassVar[AutoChoice]
    AUTO_CHOICE_SHORT_OUTPUT: _ClassVar[AutoChoice]
    AUTO_CHOICE_BEST_K: _ClassVar[AutoChoice]
    AUTO_CHOICE_LOW_GAIN: _ClassVar[AutoChoice]
    AUTO_CHOICE_PROBE: _ClassVar[AutoChoice]
    AUTO_CHOICE_LOAD: _ClassVar[AutoChoice]
    AUTO_CHOICE_SCHEDULE: _ClassVar[AutoChoice]
    AUTO_CHOICE_NOT_OPENED: _ClassVar[AutoChoice]

class ClosingToken(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLOSING_TOKEN_UNSPECIFIED: _ClassVar[ClosingToken]
    CLOSING_TOKEN_CORRECTION: _ClassVar[ClosingToken]
    CLOSING_TOKEN_BONUS: _ClassVar[ClosingToken]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_ON: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_AUTO: SpeculationMode
TARGET_ONLY_REASON_UNSPECIFIED: TargetOnlyReason
TARGET_ONLY_REASON_OFF_BY_REQUEST: TargetOnlyReason
TARGET_ONLY_REASON_DRAFT_UNAVAILABLE: TargetOnlyReason
TARGET_ONLY_REASON_DRAFT_TIMED_OUT: TargetOnlyReason
TARGET_ONLY_REASON_DRAFT_REFUSED: TargetOnlyReason
TARGET_ONLY_REASON_AUTO_SHORT_OUTPUT: TargetOnlyReason
TARGET_ONLY_REASON_AUTO_LOW_GAIN: TargetOnlyReason
TARGET_ONLY_REASON_AUTO_NOT_OPENED: TargetOnlyReason
AUTO_CHOICE_UNSPECIFIED: AutoChoice
AUTO_CHOICE_SHORT_OUTPUT: AutoChoice
AUTO_CHOICE_BEST_K: AutoChoice
AUTO_CHOICE_LOW_GAIN: AutoChoice
AUTO_CHOICE_PROBE: AutoChoice
AUTO_CHOICE_LOAD: AutoChoice
AUTO_CHOICE_SCHEDULE: AutoChoice
AUTO_CHOICE_NOT_OPENED: AutoChoice
CLOSING_TOKEN_UNSPECIFIED: ClosingToken
CLOSING_TOKEN_CORRECTION: ClosingToken
CLOSING_TOKEN_BONUS: ClosingToken
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("speculating", "reason", "detail")
    SPECULATING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    speculating: bool
    reason: TargetOnlyReason
    detail: str
    def __init__(self, speculating: _Optional[bool] = ..., reason: _Optional[_Union[TargetOnlyReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("index", "draft_tokens", "accepted_tokens", "closing", "draft_time_us", "verify_time_us", "draft_compute_us", "mode", "auto_choice", "expected_gain", "alpha_estimate", "batch_sessions", "batch_positions", "predicted_tokens_per_s")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_US_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_US_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    AUTO_CHOICE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GAIN_FIELD_NUMBER: _ClassVar[int]
    ALPHA_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    index: int
    draft_tokens: int
    accepted_tokens: int
    closing: ClosingToken
    draft_time_us: int
    verify_time_us: int
    draft_compute_us: int
    mode: SpeculationMode
    auto_choice: AutoChoice
    expected_gain: float
    alpha_estimate: float
    batch_sessions: int
    batch_positions: int
    predicted_tokens_per_s: float
    def __init__(self, index: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., closing: _Optional[_Union[ClosingToken, str]] = ..., draft_time_us: _Optional[int] = ..., verify_time_us: _Optional[int] = ..., draft_compute_us: _Optional[int] = ..., mode: _Optional[_Union[SpeculationMode, str]] = ..., auto_choice: _Optional[_Union[AutoChoice, str]] = ..., expected_gain: _Optional[float] = ..., alpha_estimate: _Optional[float] = ..., batch_sessions: _Optional[int] = ..., batch_positions: _Optional[int] = ..., predicted_tokens_per_s: _Optional[float] = ...) -> None: ...

class KVPoolInfo(_message.Message):
    __slots__ = ("capacity_tokens", "reserved_tokens", "used_tokens", "bytes")
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    capacity_tokens: int
    reserved_tokens: int
    used_tokens: int
    bytes: int
    def __init__(self, capacity_tokens: _Optional[int] = ..., reserved_tokens: _Optional[int] = ..., used_tokens: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "rounds", "draft_tokens_proposed", "draft_tokens_accepted", "rejections", "acceptance_rate", "alpha_hat")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_HAT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    rejections: int
    acceptance_rate: float
    alpha_hat: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., rejections: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., alpha_hat: _Optional[float] = ...) -> None: ...
