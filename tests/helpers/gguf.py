"""A small GGUF file written byte by byte (little-endian, version 3): string key-values and fp32 tensors, and
where each of its sections starts, for the tests that cut it."""

from __future__ import annotations

import struct
from pathlib import Path


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(path: Path, kv: dict[str, str], tensors: dict[str, list[float]]) -> dict[str, int]:
    """Write the file; return the byte where each section starts (``kv``, ``tensor_infos``, ``data``) and the
    file's ``size``."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv) + 1)
    kvs = _string("general.alignment") + struct.pack("<II", 4, 32)
    for k, v in kv.items():
        kvs += _string(k) + struct.pack("<I", 8) + _string(v)
    infos, data, offset = b"", b"", 0
    for name, values in tensors.items():
        infos += _string(name) + struct.pack("<IQIQ", 1, len(values), 0, offset)
        blob = struct.pack(f"<{len(values)}f", *values)
        blob += b"\0" * (-len(blob) % 32)
        data += blob
        offset += len(blob)
    body = head + kvs + infos
    pad = b"\0" * (-len(body) % 32)
    path.write_bytes(body + pad + data)
    return {"kv": len(head), "tensor_infos": len(head) + len(kvs), "data": len(body + pad),
            "size": len(body + pad + data)}
