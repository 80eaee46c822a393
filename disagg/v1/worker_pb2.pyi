from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConstraintKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSTRAINT_KIND_UNSPECIFIED: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_OBJECT: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_SCHEMA: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_REGEX: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_CHOICE: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_GRAMMAR: _ClassVar[ConstraintKind]

class WorkerFinish(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_FINISH_NONE: _ClassVar[WorkerFinish]
    WORKER_FINISH_LENGTH: _ClassVar[WorkerFinish]
    WORKER_FINISH_STOP: _ClassVar[WorkerFinish]

class KvKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_KIND_UNSPECIFIED: _ClassVar[KvKind]
    KV_KIND_KEY: _ClassVar[KvKind]
    KV_KIND_VALUE: _ClassVar[KvKind]
CONSTRAINT_KIND_UNSPECIFIED: ConstraintKind
CONSTRAINT_KIND_JSON_OBJECT: ConstraintKind
CONSTRAINT_KIND_JSON_SCHEMA: ConstraintKind
CONSTRAINT_KIND_REGEX: ConstraintKind
CONSTRAINT_KIND_CHOICE: ConstraintKind
CONSTRAINT_KIND_GRAMMAR: ConstraintKind
WORKER_FINISH_NONE: WorkerFinish
WORKER_FINISH_LENGTH: WorkerFinish
WORKER_FINISH_STOP: WorkerFinish
KV_KIND_UNSPECIFIED: KvKind
KV_KIND_KEY: KvKind
KV_KIND_VALUE: KvKind

class WorkerSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "constraint")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: bool
    top_logprobs: int
    constraint: WorkerConstraint
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[WorkerConstraint, _Mapping]] = ...) -> None: ...

class WorkerConstraint(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: ConstraintKind
    text: str
    def __init__(self, kind: _Optional[_Union[ConstraintKind, str]] = ..., text: _Optional[str] = ...) -> None: ...

class WorkerLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class WorkerStopping(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_ids")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PullKvRequest(_message.Message):
    __slots__ = ("reservation_id", "agent_name", "agent_metadata", "address", "prompt_len", "num_layers", "first_token", "generation", "token_start", "kv_dtype", "scale_block")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    agent_name: str
    agent_metadata: bytes
    address: int
    prompt_len: int
    num_layers: int
    first_token: int
    generation: int
    token_start: int
    kv_dtype: str
    scale_block: int
    def __init__(self, reservation_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., address: _Optional[int] = ..., prompt_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., first_token: _Optional[int] = ..., generation: _Optional[int] = ..., token_start: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., scale_block: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_len", "sampling", "stopping", "first_step", "context_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_len: int
    sampling: WorkerSampling
    stopping: WorkerStopping
    first_step: int
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., stopping: _Optional[_Union[WorkerStopping, _Mapping]] = ..., first_step: _Optional[int] = ..., context_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("reservation_id", "slot", "lease_seconds", "cached_tokens")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    slot: int
    lease_seconds: float
    cached_tokens: int
    def __init__(self, reservation_id: _Optional[str] = ..., slot: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class DecodeTokens(_message.Message):
    __slots__ = ("token_ids", "finish", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish: WorkerFinish
    logprobs: _containers.RepeatedCompositeFieldContainer[WorkerLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish: _Optional[_Union[WorkerFinish, str]] = ..., logprobs: _Optional[_Iterable[_Union[WorkerLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("reserved", "tokens")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    tokens: DecodeTokens
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., tokens: _Optional[_Union[DecodeTokens, _Mapping]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("reservation_id", "layer", "kind", "token_start", "dtype", "shape", "data", "commit", "scales", "scale_block")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    SCALE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    layer: int
    kind: KvKind
    token_start: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    commit: KvCommit
    scales: bytes
    scale_block: int
    def __init__(self, reservation_id: _Optional[str] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[KvKind, str]] = ..., token_start: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., commit: _Optional[_Union[KvCommit, _Mapping]] = ..., scales: _Optional[bytes] = ..., scale_block: _Optional[int] = ...) -> None: ...

class KvCommit(_message.Message):
    __slots__ = ("first_token", "prompt_len", "num_layers")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    prompt_len: int
    num_layers: int
    def __init__(self, first_token: _Optional[int] = ..., prompt_len: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class KvAck(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class KvTarget(_message.Message):
    __slots__ = ("address", "reservation_id", "token_start")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    address: str
    reservation_id: str
    token_start: int
    def __init__(self, address: _Optional[str] = ..., reservation_id: _Optional[str] = ..., token_start: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "kv_target", "first_step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    kv_target: KvTarget
    first_step: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., kv_target: _Optional[_Union[KvTarget, _Mapping]] = ..., first_step: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "prefill_seconds", "logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    prefill_seconds: float
    logprobs: WorkerLogprobs
    def __init__(self, token_id: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., logprobs: _Optional[_Union[WorkerLogprobs, _Mapping]] = ...) -> None: ...

class KvSent(_message.Message):
    __slots__ = ("bytes", "seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "kv_sent")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_SENT_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    kv_sent: KvSent
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., kv_sent: _Optional[_Union[KvSent, _Mapping]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("role", "capacity", "slots_in_use", "reservations", "active", "inflight_transfers", "queued", "model_name", "max_seq_len", "backend", "vocab_size", "dtype", "resident_bytes", "proportional_bytes", "shared_bytes", "kv_cache_dtype", "speculation")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROPORTIONAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    role: str
    capacity: int
    slots_in_use: int
    reservations: int
    active: int
    inflight_transfers: int
    queued: int
    model_name: str
    max_seq_len: int
    backend: str
    vocab_size: int
    dtype: str
    resident_bytes: int
    proportional_bytes: int
    shared_bytes: int
    kv_cache_dtype: str
    speculation: WorkerSpeculation
    def __init__(self, role: _Optional[str] = ..., capacity: _Optional[int] = ..., slots_in_use: _Optional[int] = ..., reservations: _Optional[int] = ..., active: _Optional[int] = ..., inflight_transfers: _Optional[int] = ..., queued: _Optional[int] = ..., model_name: _Optional[str] = ..., max_seq_len: _Optional[int] = ..., backend: _Optional[str] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., resident_bytes: _Optional[int] = ..., proportional_bytes: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., speculation: _Optional[_Union[WorkerSpeculation, _Mapping]] = ...) -> None: ...

class WorkerSpeculation(_message.Message):
    __slots__ = ("method", "num_tokens", "draft_model")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_tokens: int
    draft_model: str
    def __init__(self, method: _Optional[str] = ..., num_tokens: _Optional[int] = ..., draft_model: _Optional[str] = ...) -> None: ...
