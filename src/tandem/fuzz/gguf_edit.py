"""A GGUF file as editable parts (typed metadata, tensor table, data), written back byte for byte, or broken.

The fuzzer and the hostile-input tests edit real files through this: every field keeps its GGUF value type, so a
mutation can change a value, a type, a count or a shape and still write a file the parser reads that far.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as T

_FORMATS = {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
            T.FLOAT32: "<f", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d", T.BOOL: "<?"}  # fmt: skip


@dataclass
class Value:
    """A metadata value with its GGUF type; an array's items have `item_type` (nested arrays: Values)."""

    vtype: int
    value: Any
    item_type: int | None = None


@dataclass
class Tensor:
    name: str
    ne: list[int]  # ggml order
    ggml_type: int
    offset: int


@dataclass
class GGUFParts:
    version: int
    metadata: dict[str, Value]
    tensors: list[Tensor]
    data: bytes  # everything from the data section's start
    alignment: int = 32
    extra_kv: list[tuple[str, Value]] = field(default_factory=list)  # written after `metadata`: duplicate keys

    @classmethod
    def read(cls, path: Path) -> GGUFParts:
        buf = path.read_bytes()
        pos = 8
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, pos)
        pos += 16

        def scalar(fmt: str) -> Any:
            nonlocal pos
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = scalar("<Q")
            pos += n
            return buf[pos - n : pos].decode("utf-8", errors="replace")

        def value(vtype: int) -> Value:
            if vtype == T.STRING:
                return Value(vtype, string())
            if vtype == T.ARRAY:
                item_type, count = scalar("<I"), scalar("<Q")
                return Value(vtype, [value(item_type).value if item_type != T.ARRAY else value(item_type)
                                     for _ in range(count)], item_type)  # fmt: skip
            return Value(vtype, scalar(_FORMATS[T(vtype)]))

        metadata = {}
        for _ in range(n_kv):
            key = string()
            metadata[key] = value(scalar("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = string()
            ne = [scalar("<Q") for _ in range(scalar("<I"))]
            tensors.append(Tensor(name, ne, scalar("<I"), scalar("<Q")))
        alignment = int(metadata["general.alignment"].value) if "general.alignment" in metadata else 32
        start = -(-pos // alignment) * alignment
        return cls(version=struct.unpack_from("<I", buf, 4)[0], metadata=metadata, tensors=tensors,
                   data=buf[start:], alignment=alignment)  # fmt: skip

    def encode(self, n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
        """The file's bytes; `n_tensors` / `n_kv` replace the counts in the header (to lie about them)."""
        kvs = [*self.metadata.items(), *self.extra_kv]
        head = b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors) if n_tensors is None else n_tensors,
                                     len(kvs) if n_kv is None else n_kv)  # fmt: skip
        parts = [head]
        for key, v in kvs:
            parts.append(_string(key) + struct.pack("<I", v.vtype) + _value(v))
        for t in self.tensors:
            parts.append(_string(t.name) + struct.pack("<I", len(t.ne)) + b"".join(struct.pack("<Q", d & (2**64 - 1))
                         for d in t.ne) + struct.pack("<IQ", t.ggml_type, t.offset & (2**64 - 1)))  # fmt: skip
        header = b"".join(parts)
        align = self.alignment if self.alignment > 0 else 32
        return header + bytes(-len(header) % align) + self.data

    def write(self, path: Path) -> Path:
        path.write_bytes(self.encode())
        return path


def _string(text: str) -> bytes:
    raw = text.encode("utf-8", errors="surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _scalar(vtype: int, x: Any) -> bytes:
    fmt = _FORMATS[T(vtype)]
    if fmt in ("<f", "<d"):
        return struct.pack(fmt, float(x))
    if fmt == "<?":
        return struct.pack(fmt, bool(x))
    bits = struct.calcsize(fmt) * 8
    x = int(x) & (2**bits - 1)  # wrap, as a C writer would
    return struct.pack(fmt.upper(), x)


def _value(v: Value) -> bytes:
    if v.vtype == T.STRING:
        return _string(str(v.value))
    if v.vtype == T.ARRAY:
        assert v.item_type is not None
        out = [struct.pack("<IQ", v.item_type, len(v.value))]
        for item in v.value:
            if v.item_type == T.ARRAY:
                out.append(_value(item))
            elif v.item_type == T.STRING:
                out.append(_string(str(item)))
            else:
                out.append(_scalar(v.item_type, item))
        return b"".join(out)
    return _scalar(v.vtype, v.value)
