"""The GGUF file's structure, checked before anything loads it: a cut or garbled file is one line, not a
``struct.error`` from deep inside the loader.

A GGUF file (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, little-endian) is a header (``GGUF``,
version, tensor count, key-value count), the key-value pairs, one info per tensor (name, shape, type, offset)
and, from the next multiple of ``general.alignment`` (32), the tensors' data. :func:`check_gguf` walks the first
three without reading the data and checks that every tensor's bytes lie inside the file.
"""

from __future__ import annotations

import struct
from pathlib import Path

# value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml type -> (elements per block, bytes per block), for the types the gguf package may not know
_GGML_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
               24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2)}


class _Cut(Exception):
    def __init__(self, what: str, at: int) -> None:
        super().__init__(what)
        self.what, self.at = what, at


class _Reader:
    def __init__(self, f, size: int) -> None:
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise _Cut(what, self.pos)
        self.pos += n
        return self.f.read(n)

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, length_fmt: str) -> str:
        n = self.scalar(length_fmt, f"{what}'s length")
        return self.take(n, what).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, length_fmt: str, depth: int = 0) -> object:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what, length_fmt)
        if vtype == _ARRAY and depth < 2:
            item = self.scalar("<I", f"{what}'s item type")
            n = self.scalar(length_fmt, f"{what}'s length")
            if item in _SCALARS:  # fixed-size items: skip them in one read (a vocabulary's scores, token types)
                self.take(n * struct.calcsize(_SCALARS[item]), f"{what}'s {n} items")
                return None
            for i in range(n):
                self.value(item, f"{what}[{i}]", length_fmt, depth + 1)
            return None
        raise ValueError(f"unknown value type {vtype} in {what} at byte {self.pos - 4}")


def check_gguf(path: str | Path, refetch: str = "download or copy it again") -> None:
    """ValueError, one line naming ``path``, the field and the byte where it breaks and ``refetch`` (how to
    get an intact copy), when ``path`` is not a whole GGUF file; None when its structure and sizes hold."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        r = _Reader(f, size)
        try:
            if r.take(4, "the magic number") != b"GGUF":
                raise ValueError("it does not start with GGUF")
            version = r.scalar("<I", "the version")
            if version not in (1, 2, 3):
                raise ValueError(f"GGUF version {version} (this reads 1 to 3; a big-endian file?)")
            count = "<I" if version == 1 else "<Q"
            n_tensors = r.scalar(count, "the tensor count")
            n_kv = r.scalar(count, "the key-value count")
            alignment = 32
            for i in range(n_kv):
                key = r.string(f"key {i}", count)
                vtype = r.scalar("<I", f"the type of {key}")
                v = r.value(vtype, f"the value of {key}", count)
                if key == "general.alignment" and isinstance(v, int) and v > 0:
                    alignment = v
            infos = []
            for i in range(n_tensors):
                name = r.string(f"tensor {i}'s name", count)
                n_dims = r.scalar("<I", f"tensor {name}'s dimension count")
                if n_dims > 8:
                    raise ValueError(f"tensor {name} has {n_dims} dimensions at byte {r.pos - 4}")
                dims = [r.scalar(count, f"tensor {name}'s shape") for _ in range(n_dims)]
                ggml_type = r.scalar("<I", f"tensor {name}'s type")
                offset = r.scalar("<Q", f"tensor {name}'s offset")
                infos.append((name, dims, ggml_type, offset))
        except _Cut as cut:
            raise ValueError(f"{p}: truncated or corrupt GGUF file: {cut.what} at byte {cut.at} runs past its end "
                             f"({size} bytes); {refetch}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{p}: corrupt GGUF file: {e} (read up to byte {r.pos} of {size}); {refetch}") from None
    data = -(-r.pos // alignment) * alignment
    sizes = _sizes()
    for name, dims, ggml_type, offset in infos:
        n = 1
        for d in dims:
            n *= d
        block, nbytes = sizes.get(ggml_type, (1, 0))  # an unknown type: at least its offset must lie inside
        end = data + offset + -(-n // block) * nbytes
        if end > size:
            raise ValueError(f"{p}: truncated or corrupt GGUF file: tensor {name}'s data ends at byte {end} but the "
                             f"file has {size} bytes; {refetch}")


def _sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (block elements, block bytes): the gguf package's table when it is installed, ours besides."""
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:
        return dict(_GGML_SIZES)
    return {**_GGML_SIZES, **{int(k): tuple(v) for k, v in GGML_QUANT_SIZES.items()}}
