"""A small safetensors reader and writer (memory-mapped, no framework).

Written from the format description: 8-byte little-endian header length, a JSON
header mapping tensor names to dtype, shape and byte offsets (plus an optional
``__metadata__``), then the raw little-endian tensor bytes. Tensors come back as
read-only NumPy views of a memory map, so reading a checkpoint tensor by tensor
never holds a second copy of the file in host RAM. BF16 and FP8 use
``ml_dtypes``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from moejax.config import regular_file_problem

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Param dtypes the engine computes in.
PARAM_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}

# safetensors dtype codes -> numpy dtypes (the format is little-endian throughout).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
# Only these can be weights: FP8 tensors come with scales that moejax does not apply.
WEIGHT_CODES = ("F16", "BF16", "F32", "F64")
# The format caps the JSON header at 100 MB; a larger value means a corrupt file.
_MAX_HEADER_BYTES = 100_000_000
# An index names each tensor once (DeepSeek-V3's 91k tensors: 9 MB); one past this is
# not an index, and is not read into memory.
MAX_INDEX_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint that does not match the config or the safetensors format, with the reason."""


# =========================================================================== dtypes
def resolve_dtype(dtype: str | np.dtype | type) -> np.dtype:
    """Map "float32" | "bfloat16" | "float16" (or the numpy dtype itself) to a numpy dtype."""
    if isinstance(dtype, str):
        if dtype not in PARAM_DTYPES:
            raise ValueError(f"unsupported param dtype {dtype!r}: use one of "
                             f"{', '.join(PARAM_DTYPES)}")
        return PARAM_DTYPES[dtype]
    resolved = np.dtype(dtype)
    if resolved not in PARAM_DTYPES.values():
        raise ValueError(f"unsupported param dtype {resolved}: use one of "
                         f"{', '.join(PARAM_DTYPES)}")
    return resolved


# =========================================================================== safetensors
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file; ``start``/``end`` are absolute byte offsets."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file (reads only the header bytes).
    A path that is not a regular file (a FIFO, a device) is refused without opening it."""
    path = os.fspath(path)
    _require_regular_file(path)
    file_size = os.path.getsize(path)
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
            raise CheckpointError(f"{path}: header length {header_len} does not fit in a "
                                  f"{file_size}-byte file")
        raw = fh.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    data_size = file_size - data_start
    metadata = header.pop("__metadata__", None) or {}
    tensors = {name: _tensor_info(path, name, entry, data_start, data_size)
               for name, entry in header.items()}
    return SafetensorsHeader(tensors=tensors, metadata=dict(metadata), data_start=data_start)


def _require_regular_file(path: str) -> None:
    problem = regular_file_problem(path)
    if problem:
        raise CheckpointError(f"{path}: {problem}")


def _tensor_info(path: str, name: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
    try:
        code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(n) for n in shape)
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{path}: malformed header entry for {name}: {entry!r}") from None
    if code not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {code}")
    nbytes = math.prod(shape) * SAFETENSORS_DTYPES[code].itemsize
    if any(n < 0 for n in shape) or not 0 <= begin <= end <= data_size or end - begin != nbytes:
        raise CheckpointError(f"{path}: tensor {name} ({code}, shape {shape}) has inconsistent "
                              f"data_offsets [{begin}, {end}] (data section is {data_size} bytes)")
    return TensorInfo(dtype=code, shape=shape, start=data_start + begin, end=data_start + end)


class SafetensorsFile:
    """Read-only, memory-mapped access to the tensors of one safetensors file.

    Arrays returned by :meth:`get` are views into the mapping (no copy, not writeable); the
    pages are read from disk only when touched.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.header = read_safetensors_header(self.path)
        with open(self.path, "rb") as fh:  # the mapping stays valid after the file closes
            self._buffer = np.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ),
                                         dtype=np.uint8)

    def keys(self) -> list[str]:
        return list(self.header.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.header.tensors[name]

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only numpy view of the file."""
        info = self.header.tensors[name]
        flat = self._buffer[info.start:info.end].view(SAFETENSORS_DTYPES[info.dtype])
        return flat.reshape(info.shape)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        # Views may still reference the mapping; dropping our reference lets it close with them.
        self._buffer = np.zeros(0, np.uint8)


def _read_weight_map(index_path: str) -> dict[str, Any]:
    """The ``weight_map`` of an index file, read only when it is a regular file of at most
    MAX_INDEX_BYTES."""
    _require_regular_file(index_path)
    size = os.path.getsize(index_path)
    if size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index_path}: {size} bytes, more than an index's limit of "
                              f"{MAX_INDEX_BYTES} (moejax.safetensors_io.MAX_INDEX_BYTES)")
    try:
        with open(index_path, encoding="utf-8") as fh:
            index = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{index_path}: not a valid JSON index ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: no weight_map")
    return weight_map


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file (names sorted, header space-padded to 8 bytes).

    The output is a pure function of the inputs, so equal tensors give equal bytes.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            raise ValueError(f"{name}: dtype {array.dtype} cannot be stored in safetensors")
        array = array.astype(SAFETENSORS_DTYPES[code], copy=False)  # little-endian on disk
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # keeps the data section 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for array in arrays:
            fh.write(array.reshape(-1).view(np.uint8).data)  # no intermediate bytes copy


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def shard_roots(model_dir: str) -> tuple[str, ...]:
    """Where a model directory's shards may lie once symlinks are resolved: the directory
    itself, and for a Hugging Face hub snapshot (``models--ORG--NAME/snapshots/REV``,
    whose files are symlinks to ``../../blobs/HASH``) that repository's ``blobs``."""
    root = os.path.realpath(model_dir)
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) == "snapshots":
        return root, os.path.join(os.path.dirname(snapshots), "blobs")
    return (root,)


def shard_name_problem(file_name: Any, model_dir: str) -> str | None:
    """Why an index's shard entry is not a plain file name inside ``model_dir``, or None.

    Decided from the name and the symlinks on its way alone: the file itself is neither
    opened nor stat'ed, so an entry such as ``../outside.safetensors`` or ``/etc/passwd``
    learns nothing about the file it names."""
    if not isinstance(file_name, str) or not file_name:
        return "must be a non-empty file name"
    if (file_name in (".", "..") or "/" in file_name or "\\" in file_name
            or "\0" in file_name or os.path.isabs(file_name)):
        return ("must be a plain file name inside the model directory (no directory "
                "separator, no '..', not absolute)")
    resolved = os.path.realpath(os.path.join(model_dir, file_name))
    if not any(_inside(resolved, root) for root in shard_roots(model_dir)):
        return "is a symlink that leads out of the model directory"
    return None


class CheckpointReader:
    """The tensors of a HF model directory: ``model.safetensors`` or a sharded index.

    An index's shards must be plain file names in the directory (after symlinks, still in
    it: :func:`shard_name_problem`); every model file must be a regular file (a FIFO or a
    device is refused unopened). Violations raise :class:`CheckpointError` naming them."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        self.model_dir = os.fspath(model_dir)
        index_path = os.path.join(self.model_dir, INDEX_FILE)
        single_path = os.path.join(self.model_dir, SINGLE_FILE)
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}  # tensor name -> file name
        if os.path.exists(index_path):
            self._read_index(index_path)
        elif os.path.exists(single_path):
            self._where = {name: SINGLE_FILE for name in self._file(SINGLE_FILE).keys()}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.model_dir}")

    def _read_index(self, index_path: str) -> None:
        weight_map = _read_weight_map(index_path)
        self._check_shard_names(index_path, weight_map)
        for name, file_name in weight_map.items():
            if name not in self._file(file_name).header.tensors:
                raise CheckpointError(f"{index_path}: maps {name} to {file_name}, "
                                      "which does not contain it")
        self._where = dict(weight_map)

    def _check_shard_names(self, index_path: str, weight_map: dict[str, Any]) -> None:
        """Every shard entry, before any shard is opened (one check per distinct name)."""
        checked: set[Any] = set()
        for name, file_name in weight_map.items():
            key = file_name if isinstance(file_name, str) else repr(file_name)
            if key in checked:
                continue
            checked.add(key)
            problem = shard_name_problem(file_name, self.model_dir)
            if problem:
                raise CheckpointError(f"{index_path}: weight_map entry {name!r}: shard "
                                      f"{file_name!r} {problem}")

    def _file(self, file_name: str) -> SafetensorsFile:
        if file_name not in self._files:
            path = os.path.join(self.model_dir, file_name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"checkpoint shard {path} is missing")
            self._files[file_name] = SafetensorsFile(path)
        return self._files[file_name]

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def info(self, name: str) -> TensorInfo:
        return self._file(self._where[name]).info(name)

    def get(self, name: str) -> np.ndarray:
        return self._file(self._where[name]).get(name)


