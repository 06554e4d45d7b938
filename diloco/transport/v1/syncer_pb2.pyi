from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    FP32: _ClassVar[Encoding]
    BF16: _ClassVar[Encoding]
    INT8: _ClassVar[Encoding]
    INT4: _ClassVar[Encoding]
    SPARSE: _ClassVar[Encoding]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
ENCODING_UNSPECIFIED: Encoding
FP32: Encoding
BF16: Encoding
INT8: Encoding
INT4: Encoding
SPARSE: Encoding

class TensorPayload(_message.Message):
    __slots__ = ("name", "shape", "dtype", "encoding", "block_size", "byte_length", "top_k")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    encoding: Encoding
    block_size: int
    byte_length: int
    top_k: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., block_size: _Optional[int] = ..., byte_length: _Optional[int] = ..., top_k: _Optional[int] = ...) -> None: ...

class FragmentVersion(_message.Message):
    __slots__ = ("incarnation", "version")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    version: int
    def __init__(self, incarnation: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class FragmentHeader(_message.Message):
    __slots__ = ("fragment_id", "version", "tensors", "delta_base", "round_opened_seconds")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_FIELD_NUMBER: _ClassVar[int]
    ROUND_OPENED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    version: FragmentVersion
    tensors: _containers.RepeatedCompositeFieldContainer[TensorPayload]
    delta_base: FragmentVersion
    round_opened_seconds: float
    def __init__(self, fragment_id: _Optional[int] = ..., version: _Optional[_Union[FragmentVersion, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorPayload, _Mapping]]] = ..., delta_base: _Optional[_Union[FragmentVersion, _Mapping]] = ..., round_opened_seconds: _Optional[float] = ...) -> None: ...

class FragmentChunk(_message.Message):
    __slots__ = ("header", "data", "offset", "crc32")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    header: FragmentHeader
    data: bytes
    offset: int
    crc32: int
    def __init__(self, header: _Optional[_Union[FragmentHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("island_id", "num_fragments")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    num_fragments: int
    def __init__(self, island_id: _Optional[str] = ..., num_fragments: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("shard_index", "num_shards", "owned_fragments", "unseeded_fragments", "max_chunk_bytes")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    OWNED_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    UNSEEDED_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    owned_fragments: _containers.RepeatedScalarFieldContainer[int]
    unseeded_fragments: _containers.RepeatedScalarFieldContainer[int]
    max_chunk_bytes: int
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., owned_fragments: _Optional[_Iterable[int]] = ..., unseeded_fragments: _Optional[_Iterable[int]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class SeedReply(_message.Message):
    __slots__ = ("accepted", "version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: FragmentVersion
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[_Union[FragmentVersion, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("island_id", "fragment_id", "base", "tokens", "inner_steps", "sequence", "tensors", "step_seconds", "slack_seconds", "last")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SLACK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    fragment_id: int
    base: FragmentVersion
    tokens: int
    inner_steps: int
    sequence: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorPayload]
    step_seconds: float
    slack_seconds: float
    last: bool
    def __init__(self, island_id: _Optional[str] = ..., fragment_id: _Optional[int] = ..., base: _Optional[_Union[FragmentVersion, _Mapping]] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., sequence: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorPayload, _Mapping]]] = ..., step_seconds: _Optional[float] = ..., slack_seconds: _Optional[float] = ..., last: _Optional[bool] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data", "offset", "crc32")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    offset: int
    crc32: int
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("duplicate", "current", "staleness", "cadence_step_seconds", "arrival_seconds", "live_islands")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    CADENCE_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_ISLANDS_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    current: FragmentVersion
    staleness: int
    cadence_step_seconds: float
    arrival_seconds: float
    live_islands: int
    def __init__(self, duplicate: _Optional[bool] = ..., current: _Optional[_Union[FragmentVersion, _Mapping]] = ..., staleness: _Optional[int] = ..., cadence_step_seconds: _Optional[float] = ..., arrival_seconds: _Optional[float] = ..., live_islands: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("fragment_id", "have", "encoding", "island_id", "held", "delta_encoding")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    DELTA_ENCODING_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    have: FragmentVersion
    encoding: Encoding
    island_id: str
    held: HeldValues
    delta_encoding: Encoding
    def __init__(self, fragment_id: _Optional[int] = ..., have: _Optional[_Union[FragmentVersion, _Mapping]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., island_id: _Optional[str] = ..., held: _Optional[_Union[HeldValues, _Mapping]] = ..., delta_encoding: _Optional[_Union[Encoding, str]] = ...) -> None: ...

class HeldValues(_message.Message):
    __slots__ = ("version", "digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: FragmentVersion
    digest: int
    def __init__(self, version: _Optional[_Union[FragmentVersion, _Mapping]] = ..., digest: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("island_id",)
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    def __init__(self, island_id: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("fragment_id", "seeded", "version", "pending", "last_contributors", "last_merge_unix", "max_staleness_seen", "tokens_merged")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEEDED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    LAST_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    LAST_MERGE_UNIX_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_SEEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MERGED_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    seeded: bool
    version: FragmentVersion
    pending: int
    last_contributors: int
    last_merge_unix: float
    max_staleness_seen: int
    tokens_merged: int
    def __init__(self, fragment_id: _Optional[int] = ..., seeded: _Optional[bool] = ..., version: _Optional[_Union[FragmentVersion, _Mapping]] = ..., pending: _Optional[int] = ..., last_contributors: _Optional[int] = ..., last_merge_unix: _Optional[float] = ..., max_staleness_seen: _Optional[int] = ..., tokens_merged: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("shard_index", "num_shards", "fragments", "live_islands", "rejected_pushes", "left_islands", "accepted_tokens", "lineage")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_ISLANDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    LEFT_ISLANDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    live_islands: _containers.RepeatedScalarFieldContainer[str]
    rejected_pushes: int
    left_islands: _containers.RepeatedScalarFieldContainer[str]
    accepted_tokens: _containers.RepeatedScalarFieldContainer[str]
    lineage: int
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., live_islands: _Optional[_Iterable[str]] = ..., rejected_pushes: _Optional[int] = ..., left_islands: _Optional[_Iterable[str]] = ..., accepted_tokens: _Optional[_Iterable[str]] = ..., lineage: _Optional[int] = ...) -> None: ...
