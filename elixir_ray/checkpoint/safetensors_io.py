"""The safetensors file format, written and read with numpy: a JSON header, then raw little-endian bytes.

Loading can never run code (no pickle), and the files open in any safetensors reader.
"""

from __future__ import annotations

import json
import struct

import numpy as np

_TO_CODE = {
    np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8", np.dtype("uint16"): "U16", np.dtype("bool"): "BOOL",
}
_FROM_CODE = {code: dtype for dtype, code in _TO_CODE.items()}


def encode(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _TO_CODE:
            raise TypeError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot store")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": _TO_CODE[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([struct.pack("<Q", len(head)), head] + [a.tobytes() for a in arrays])


def decode(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse and bounds-check a safetensors payload; raises ValueError on anything malformed."""
    if len(payload) < 8:
        raise ValueError("truncated safetensors file: no header length")
    (n,) = struct.unpack("<Q", payload[:8])
    if 8 + n > len(payload):
        raise ValueError("truncated safetensors file: header runs past the end")
    try:
        header = json.loads(payload[8: 8 + n])
    except json.JSONDecodeError as exc:
        raise ValueError(f"corrupt safetensors header: {exc}") from None
    metadata = header.pop("__metadata__", {}) or {}
    data = memoryview(payload)[8 + n:]
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = _FROM_CODE.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
        count = int(np.prod(info["shape"])) if info["shape"] else 1
        if not 0 <= start <= end <= len(data) or end - start != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r} has offsets outside the file")
        out[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(info["shape"])
    return out, metadata
