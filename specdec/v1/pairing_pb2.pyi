from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PairingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAIRING_STATE_UNSPECIFIED: _ClassVar[PairingState]
    PAIRING_STATE_PAIRED: _ClassVar[PairingState]
    PAIRING_STATE_REFUSED: _ClassVar[PairingState]
    PAIRING_STATE_UNREACHABLE: _ClassVar[PairingState]
    PAIRING_STATE_NOT_CONFIGURED: _ClassVar[PairingState]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_UNIX_SOCKET: _ClassVar[Transport]
    TRANSPORT_TCP: _ClassVar[Transport]

class GpuLink(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_LINK_UNSPECIFIED: _ClassVar[GpuLink]
    GPU_LINK_NONE_CPU: _ClassVar[GpuLink]
    GPU_LINK_SAME_DEVICE: _ClassVar[GpuLink]
    GPU_LINK_MIG_SLICE: _ClassVar[GpuLink]
    GPU_LINK_NVLINK: _ClassVar[GpuLink]
    GPU_LINK_PCIE: _ClassVar[GpuLink]
    GPU_LINK_UNKNOWN: _ClassVar[GpuLink]
PAIRING_STATE_UNSPECIFIED: PairingState
PAIRING_STATE_PAIRED: PairingState
PAIRING_STATE_REFUSED: PairingState
PAIRING_STATE_UNREACHABLE: PairingState
PAIRING_STATE_NOT_CONFIGURED: PairingState
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_UNIX_SOCKET: Transport
TRANSPORT_TCP: Transport
GPU_LINK_UNSPECIFIED: GpuLink
GPU_LINK_NONE_CPU: GpuLink
GPU_LINK_SAME_DEVICE: GpuLink
GPU_LINK_MIG_SLICE: GpuLink
GPU_LINK_NVLINK: GpuLink
GPU_LINK_PCIE: GpuLink
GPU_LINK_UNKNOWN: GpuLink

class HostIdentity(_message.Message):
    __slots__ = ("boot_id", "hostname", "pid")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    hostname: str
    pid: int
    def __init__(self, boot_id: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class DeviceFacts(_message.Message):
    __slots__ = ("device", "gpu_uuid", "gpu_name")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    device: str
    gpu_uuid: str
    gpu_name: str
    def __init__(self, device: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., gpu_name: _Optional[str] = ...) -> None: ...

class ModelFacts(_message.Message):
    __slots__ = ("name", "parameters", "vocab_size", "max_positions", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    parameters: int
    vocab_size: int
    max_positions: int
    dtype: str
    def __init__(self, name: _Optional[str] = ..., parameters: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_positions: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class TokenizerFingerprint(_message.Message):
    __slots__ = ("present", "vocab_size", "vocab_sha256", "vocab_block_sha256", "merges", "merges_sha256", "special_tokens", "pipeline_sha256")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SHA256_FIELD_NUMBER: _ClassVar[int]
    VOCAB_BLOCK_SHA256_FIELD_NUMBER: _ClassVar[int]
    MERGES_FIELD_NUMBER: _ClassVar[int]
    MERGES_SHA256_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_SHA256_FIELD_NUMBER: _ClassVar[int]
    present: bool
    vocab_size: int
    vocab_sha256: str
    vocab_block_sha256: _containers.RepeatedScalarFieldContainer[str]
    merges: int
    merges_sha256: str
    special_tokens: _containers.RepeatedScalarFieldContainer[str]
    pipeline_sha256: str
    def __init__(self, present: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., vocab_sha256: _Optional[str] = ..., vocab_block_sha256: _Optional[_Iterable[str]] = ..., merges: _Optional[int] = ..., merges_sha256: _Optional[str] = ..., special_tokens: _Optional[_Iterable[str]] = ..., pipeline_sha256: _Optional[str] = ...) -> None: ...

class MemoryFacts(_message.Message):
    __slots__ = ("kind", "total_bytes", "weights_bytes", "kv_budget_bytes", "used_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    total_bytes: int
    weights_bytes: int
    kv_budget_bytes: int
    used_bytes: int
    def __init__(self, kind: _Optional[str] = ..., total_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class PeerFacts(_message.Message):
    __slots__ = ("host", "device", "model", "tokenizer", "memory")
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    host: HostIdentity
    device: DeviceFacts
    model: ModelFacts
    tokenizer: TokenizerFingerprint
    memory: MemoryFacts
    def __init__(self, host: _Optional[_Union[HostIdentity, _Mapping]] = ..., device: _Optional[_Union[DeviceFacts, _Mapping]] = ..., model: _Optional[_Union[ModelFacts, _Mapping]] = ..., tokenizer: _Optional[_Union[TokenizerFingerprint, _Mapping]] = ..., memory: _Optional[_Union[MemoryFacts, _Mapping]] = ...) -> None: ...

class Pairing(_message.Message):
    __slots__ = ("state", "transport", "link", "link_detail", "same_host", "verifier_host", "draft_host", "tokenizer_match", "tokenizer_difference", "target_memory_share", "target_memory", "warnings", "overrides", "status", "detail", "draft", "checked_at_unix_ms")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    LINK_DETAIL_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_HOST_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HOST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_MATCH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIFFERENCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MEMORY_SHARE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MEMORY_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CHECKED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    state: PairingState
    transport: Transport
    link: GpuLink
    link_detail: str
    same_host: bool
    verifier_host: str
    draft_host: str
    tokenizer_match: bool
    tokenizer_difference: str
    target_memory_share: float
    target_memory: MemoryFacts
    warnings: _containers.RepeatedScalarFieldContainer[str]
    overrides: _containers.RepeatedScalarFieldContainer[str]
    status: str
    detail: str
    draft: PeerFacts
    checked_at_unix_ms: int
    def __init__(self, state: _Optional[_Union[PairingState, str]] = ..., transport: _Optional[_Union[Transport, str]] = ..., link: _Optional[_Union[GpuLink, str]] = ..., link_detail: _Optional[str] = ..., same_host: _Optional[bool] = ..., verifier_host: _Optional[str] = ..., draft_host: _Optional[str] = ..., tokenizer_match: _Optional[bool] = ..., tokenizer_difference: _Optional[str] = ..., target_memory_share: _Optional[float] = ..., target_memory: _Optional[_Union[MemoryFacts, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ..., overrides: _Optional[_Iterable[str]] = ..., status: _Optional[str] = ..., detail: _Optional[str] = ..., draft: _Optional[_Union[PeerFacts, _Mapping]] = ..., checked_at_unix_ms: _Optional[int] = ...) -> None: ...

class PairRequest(_message.Message):
    __slots__ = ("verifier", "allow_different_tokenizer")
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DIFFERENT_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    verifier: PeerFacts
    allow_different_tokenizer: bool
    def __init__(self, verifier: _Optional[_Union[PeerFacts, _Mapping]] = ..., allow_different_tokenizer: _Optional[bool] = ...) -> None: ...

class PairResponse(_message.Message):
    __slots__ = ("draft", "pairing_id", "step_time_us")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PAIRING_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_US_FIELD_NUMBER: _ClassVar[int]
    draft: PeerFacts
    pairing_id: str
    step_time_us: int
    def __init__(self, draft: _Optional[_Union[PeerFacts, _Mapping]] = ..., pairing_id: _Optional[str] = ..., step_time_us: _Optional[int] = ...) -> None: ...
