"""The safetensors file format, written and read with numpy: a JSON header, then raw little-endian bytes.

Loading can never run code (no pickle), and the files open in any safetensors reader.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from typing import BinaryIO, Callable, Optional

import numpy as np

_TO_CODE = {
    np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8", np.dtype("uint16"): "U16", np.dtype("bool"): "BOOL",
}
_FROM_CODE = {code: dtype for dtype, code in _TO_CODE.items()}


def _code(name: str, dtype: np.dtype) -> str:
    if np.dtype(dtype) not in _TO_CODE:
        raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
    return _TO_CODE[np.dtype(dtype)]


def _head(specs: dict[str, tuple[tuple, np.dtype]], metadata: Optional[dict]) -> bytes:
    header: dict = {}
    offset = 0
    for name in sorted(specs):
        shape, dtype = specs[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _code(name, dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def encode(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    arrays = {name: np.asarray(tensors[name]) for name in tensors}
    head = _head({name: (a.shape, a.dtype) for name, a in arrays.items()}, metadata)
    return b"".join([head] + [_little_endian(arrays[name]).tobytes() for name in sorted(arrays)])


def _little_endian(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr).reshape(np.shape(arr))  # ascontiguousarray makes a 0-d array 1-d
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False)


MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit too
WRITE_BLOCK = 64 * 2**20  # bytes written (and reported to `on_bytes`) at a time


def write(out: BinaryIO, names: list[str], get: Callable[[str], np.ndarray],
          spec_of: Callable[[str], tuple[tuple, np.dtype]], metadata: Optional[dict] = None,
          on_bytes: Optional[Callable[[int], None]] = None) -> tuple[str, int]:
    """Stream one file of `names` to `out`, fetching each tensor with `get` only when its bytes are
    written, so that a file's tensors are never all in memory at once (or joined before they are
    needed). `spec_of` gives (shape, dtype) without the data, for the header; `on_bytes` hears of
    every block written (a slow filesystem is progress, not a stall). Returns the file's sha256
    (hex) and size in bytes."""
    digest = hashlib.sha256()
    specs = {name: (tuple(spec_of(name)[0]), np.dtype(spec_of(name)[1])) for name in names}
    head = _head(specs, metadata)
    digest.update(head)
    out.write(head)
    size = len(head)
    for name in sorted(specs):
        arr = _little_endian(np.asarray(get(name)))
        if tuple(arr.shape) != specs[name][0] or arr.dtype != specs[name][1].newbyteorder("<"):
            raise ValueError(f"tensor {name!r} is {arr.dtype}{list(arr.shape)}, but its header said "
                             f"{specs[name][1]}{list(specs[name][0])}")
        view = memoryview(arr.reshape(-1).view(np.uint8))
        for start in range(0, len(view), WRITE_BLOCK):
            block = view[start: start + WRITE_BLOCK]
            digest.update(block)
            out.write(block)
            if on_bytes is not None:
                on_bytes(len(block))
        size += arr.nbytes
        arr = view = block = None
    return digest.hexdigest(), size


def spec_of_mapping(tensors: Mapping) -> Callable[[str], tuple[tuple, np.dtype]]:
    """(shape, dtype) of each tensor, without joining it where the mapping can say (`spec_of`)."""
    own = getattr(tensors, "spec_of", None)
    if own is not None:
        return own

    def spec(name: str):
        arr = np.asarray(tensors[name])
        return arr.shape, arr.dtype
    return spec


def read_header(read_at: Callable[[int, int], bytes], size: int) -> tuple[dict, int]:
    """A safetensors file's header through `read_at(nbytes, offset)`, and where its data starts;
    bounds-checked like `decode`, so a lazy reader can trust the offsets."""
    if size < 8:
        raise ValueError("truncated safetensors file: no header length")
    (n,) = struct.unpack("<Q", read_at(8, 0))
    if 8 + n > size:
        raise ValueError("truncated safetensors file: header runs past the end")
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header of {n} bytes, more than the {MAX_HEADER_BYTES} any reader accepts")
    try:
        header = json.loads(read_at(n, 8))
    except (ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise ValueError(f"corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(name, info, size - 8 - n)
    return header, 8 + n


def dtype_of(code: str) -> np.dtype:
    return _FROM_CODE[code]


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(name: str, info: dict, data_len: int) -> np.dtype:
    """One header entry, checked in Python integers before numpy sees it: a shape of whole numbers
    >= 0 whose bytes (no overflow: `[2**32, 2**32]` is 2**64 elements here, not 0) are exactly its
    offsets' range, inside the file's data."""
    try:
        start, end = info["data_offsets"]
        dtype = _FROM_CODE.get(info["dtype"])
        shape = list(info["shape"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"tensor {name!r} has a malformed header entry") from None
    if dtype is None:
        raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
    if not all(_is_count(d) for d in shape):
        raise ValueError(f"tensor {name!r} has shape {shape!r} in its header, not whole numbers >= 0")
    if not (_is_count(start) and _is_count(end)):
        raise ValueError(f"tensor {name!r} has offsets {[start, end]!r} in its header, not whole numbers >= 0")
    nbytes = math.prod(shape) * dtype.itemsize
    if not start <= end <= data_len or end - start != nbytes:
        raise ValueError(f"tensor {name!r} has offsets outside the file: shape {shape} is {nbytes} bytes, its "
                         f"offsets [{start}, {end}) of {data_len}")
    return dtype


def decode(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse and bounds-check a safetensors payload; raises ValueError on anything malformed."""
    if len(payload) < 8:
        raise ValueError("truncated safetensors file: no header length")
    (n,) = struct.unpack("<Q", payload[:8])
    if 8 + n > len(payload):
        raise ValueError("truncated safetensors file: header runs past the end")
    try:
        header = json.loads(payload[8: 8 + n])
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("corrupt safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    data = memoryview(payload)[8 + n:]
    out = {}
    for name, info in header.items():
        dtype = _check_entry(name, info, len(data))
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(info["shape"])
    return out, metadata
