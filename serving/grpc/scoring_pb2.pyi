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

class ScoreRequest(_message.Message):
    __slots__ = ("string_id", "int_id", "prompt", "prompt_token_ids", "candidates", "candidate_token_ids", "kind", "normalize", "messages", "templates_json", "top_logprobs", "add_special_tokens")
    STRING_ID_FIELD_NUMBER: _ClassVar[int]
    INT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATES_JSON_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    string_id: str
    int_id: int
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    candidates: _containers.RepeatedScalarFieldContainer[str]
    candidate_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    kind: str
    normalize: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    templates_json: str
    top_logprobs: int
    add_special_tokens: bool
    def __init__(self, string_id: _Optional[str] = ..., int_id: _Optional[int] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., candidates: _Optional[_Iterable[str]] = ..., candidate_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., kind: _Optional[str] = ..., normalize: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., templates_json: _Optional[str] = ..., top_logprobs: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class IndexList(_message.Message):
    __slots__ = ("indices",)
    INDICES_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, indices: _Optional[_Iterable[int]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("engines", "rounds", "seconds", "queue_seconds")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedScalarFieldContainer[int]
    rounds: _containers.RepeatedScalarFieldContainer[int]
    seconds: float
    queue_seconds: float
    def __init__(self, engines: _Optional[_Iterable[int]] = ..., rounds: _Optional[_Iterable[int]] = ..., seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("string_id", "int_id", "logprobs", "label", "prompt_tokens", "error", "selected", "timings", "warnings", "token_ids", "top", "scores")
    STRING_ID_FIELD_NUMBER: _ClassVar[int]
    INT_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    string_id: str
    int_id: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    label: int
    prompt_tokens: int
    error: str
    selected: IndexList
    timings: Timings
    warnings: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, string_id: _Optional[str] = ..., int_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., label: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., error: _Optional[str] = ..., selected: _Optional[_Union[IndexList, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., warnings: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., top: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request", "index")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request: ScoreRequest
    index: int
    def __init__(self, request: _Optional[_Union[ScoreRequest, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class StreamResult(_message.Message):
    __slots__ = ("index", "result")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    index: int
    result: ScoreResult
    def __init__(self, index: _Optional[int] = ..., result: _Optional[_Union[ScoreResult, _Mapping]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("architecture", "vocab_size", "max_context", "num_layers", "num_experts", "experts_per_token", "dtype", "backend", "devices", "device", "theta_flops", "theta_source", "max_batch_tokens", "engines", "demo", "max_queued_tokens", "max_message_bytes", "info_json", "model_name", "max_text_bytes", "max_token_ids", "max_candidates", "generation", "max_generation_streams")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    THETA_FLOPS_FIELD_NUMBER: _ClassVar[int]
    THETA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    DEMO_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_GENERATION_STREAMS_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    vocab_size: int
    max_context: int
    num_layers: int
    num_experts: int
    experts_per_token: int
    dtype: str
    backend: str
    devices: int
    device: str
    theta_flops: float
    theta_source: str
    max_batch_tokens: int
    engines: int
    demo: bool
    max_queued_tokens: int
    max_message_bytes: int
    info_json: str
    model_name: str
    max_text_bytes: int
    max_token_ids: int
    max_candidates: int
    generation: bool
    max_generation_streams: int
    def __init__(self, architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., experts_per_token: _Optional[int] = ..., dtype: _Optional[str] = ..., backend: _Optional[str] = ..., devices: _Optional[int] = ..., device: _Optional[str] = ..., theta_flops: _Optional[float] = ..., theta_source: _Optional[str] = ..., max_batch_tokens: _Optional[int] = ..., engines: _Optional[int] = ..., demo: _Optional[bool] = ..., max_queued_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., info_json: _Optional[str] = ..., model_name: _Optional[str] = ..., max_text_bytes: _Optional[int] = ..., max_token_ids: _Optional[int] = ..., max_candidates: _Optional[int] = ..., generation: _Optional[bool] = ..., max_generation_streams: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("string_id", "int_id", "prompt", "prompt_token_ids", "max_new_tokens", "temperature", "top_p", "seed", "stop_token_ids", "add_special_tokens")
    STRING_ID_FIELD_NUMBER: _ClassVar[int]
    INT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    string_id: str
    int_id: int
    prompt: str
    prompt_token_ids: TokenIds
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: TokenIds
    add_special_tokens: bool
    def __init__(self, string_id: _Optional[str] = ..., int_id: _Optional[int] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "text", "prompt_tokens", "string_id", "int_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRING_ID_FIELD_NUMBER: _ClassVar[int]
    INT_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    text: str
    prompt_tokens: int
    string_id: str
    int_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., string_id: _Optional[str] = ..., int_id: _Optional[int] = ...) -> None: ...
