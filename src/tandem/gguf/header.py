"""A fast parser of the GGUF header (metadata and tensor table).

The `gguf` package's GGUFReader builds one numpy view per string, which takes 24 s on Gemma's
262k-token vocabulary; this reads the same layout in well under a second. Types and tables still
come from the `gguf` package.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType

_SCALARS: dict[GGUFValueType, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
}


class HeaderError(ValueError):
    """The header is malformed or runs past the end of the file."""


# Sane maxima, far above any real model's, so that a hostile header is refused before it costs memory or time; the
# counts are also bounded by the bytes the file holds (every item takes at least its smallest encoding).
MAX_DEPTH = 8  # arrays of arrays: real files nest one level at most
MAX_STRING_BYTES = 64 << 20  # the longest real values are chat templates of some 100 KiB
MAX_ARRAY_ITEMS = 1 << 24  # the largest real arrays are vocabularies and merges of ~10^6 entries
MAX_NESTED_ARRAYS = 1 << 16  # arrays of arrays: a Python list each, far slower to build than numbers
MAX_NAME_BYTES = 63  # ggml's GGML_MAX_NAME less its NUL: the longest tensor name llama.cpp loads
MAX_KEY_BYTES = 256
MAX_ALIGNMENT = 1 << 30
MAX_ELEMENTS = (1 << 63) - 1  # ggml's int64 element counts
_MIN_ARRAY_BYTES = 12  # item type and count


def quote(text: str, limit: int = 80) -> str:
    """A name or value from the file as it appears in a one-line message: repr-escaped (control characters, quotes
    and newlines cannot break the line or fake other output) and cut to `limit` characters."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def one_line(text: str, limit: int = 200) -> str:
    """A message from elsewhere (an exception's text, which may echo the file) on one line, cut to `limit`: runs of
    white space become one space, other control characters are escaped."""
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


@dataclass(frozen=True)
class RawTensorEntry:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    ggml_type: int
    offset: int  # relative to the start of the data section


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[RawTensorEntry]
    data_start: int


class _Cursor:
    def __init__(self, buf: Any, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0
        self.nested_arrays = 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise HeaderError(f"header runs past the end of the file at byte {self.pos} (needs {n} more)")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, limit: int = MAX_STRING_BYTES) -> str:
        n = self.scalar("<Q")
        if n > limit:
            raise HeaderError(f"string of {n} bytes at byte {self.pos - 8} (at most {limit})")
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        try:
            t = GGUFValueType(vtype)
        except ValueError:
            raise HeaderError(f"unknown metadata value type {vtype} at byte {self.pos}") from None
        if t == GGUFValueType.STRING:
            return self.string()
        if t == GGUFValueType.ARRAY:
            return self.array(depth + 1)
        return self.scalar(_SCALARS[t][0])

    def array(self, depth: int) -> list[Any]:
        if depth > MAX_DEPTH:
            raise HeaderError(f"arrays nested more than {MAX_DEPTH} deep at byte {self.pos}")
        start = self.pos
        item_type = self.scalar("<I")
        count = self.scalar("<Q")
        if count > MAX_ARRAY_ITEMS:
            raise HeaderError(f"array of {count} items at byte {start} (at most {MAX_ARRAY_ITEMS})")
        if item_type == GGUFValueType.STRING:
            self.need(8 * count)  # each string has at least its length field
            return [self.string() for _ in range(count)]
        if item_type == GGUFValueType.ARRAY:
            self.nested_arrays += count
            if self.nested_arrays > MAX_NESTED_ARRAYS:
                raise HeaderError(f"more than {MAX_NESTED_ARRAYS} arrays inside arrays (at byte {start})")
            self.need(_MIN_ARRAY_BYTES * count)
            return [self.array(depth + 1) for _ in range(count)]
        try:
            dtype = _SCALARS[GGUFValueType(item_type)][1]
        except (ValueError, KeyError):
            raise HeaderError(f"unknown array item type {item_type} at byte {self.pos}") from None
        self.need(dtype.itemsize * count)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
        self.pos += dtype.itemsize * count
        return values


def _alignment(metadata: dict[str, Any]) -> int:
    """`general.alignment`: an integer power of two (a string, float, bool or array is refused, not coerced)."""
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise HeaderError(f"general.alignment {quote(str(alignment))} is not a power of two up to {MAX_ALIGNMENT}")
    return alignment


def _tensor_entry(cur: _Cursor) -> RawTensorEntry:
    name = cur.string(limit=MAX_NAME_BYTES)
    if not name.isprintable():
        raise HeaderError(f"tensor name {quote(name)} has control characters")
    n_dims = cur.scalar("<I")
    if n_dims > 4:
        raise HeaderError(f"tensor {quote(name)} has {n_dims} dimensions (at most 4)")
    ne = tuple(cur.scalar("<Q") for _ in range(n_dims))
    if math.prod(ne) > MAX_ELEMENTS:  # Python integers: the product cannot wrap as numpy's would
        raise HeaderError(f"tensor {quote(name)} has dimensions {ne}: more than 2^63 elements")
    return RawTensorEntry(name=name, ne=ne, ggml_type=cur.scalar("<I"), offset=cur.scalar("<Q"))


def parse_header(buf: Any, size: int) -> Header:
    """Parse magic, version, metadata and the tensor table of a GGUF file held in `buf`."""
    cur = _Cursor(buf, size)
    cur.need(4)
    cur.pos = 4  # magic, checked by the caller
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise HeaderError(f"unsupported GGUF version {version} (tandem reads versions 2 and 3)")
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    # The smallest encodings: a key-value pair is a key length, a type and a byte; a tensor entry is a name
    # length, a dimension count, one dimension, a type and an offset.
    if 13 * n_kv + 32 * n_tensors > size - cur.pos:
        raise HeaderError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys in {size} bytes")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string(limit=MAX_KEY_BYTES)
        if key in metadata:
            raise HeaderError(f"metadata key {quote(key)} appears twice")
        metadata[key] = cur.value(cur.scalar("<I"))
    tensors = []
    names: set[str] = set()
    for _ in range(n_tensors):
        entry = _tensor_entry(cur)
        if entry.name in names:
            raise HeaderError(f"tensor {quote(entry.name)} appears twice")
        names.add(entry.name)
        tensors.append(entry)
    alignment = _alignment(metadata)
    if bad := next((t for t in tensors if t.offset % alignment), None):
        raise HeaderError(f"tensor {quote(bad.name)} offset {bad.offset} is not a multiple of alignment {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    return Header(version=version, metadata=metadata, tensors=tensors, data_start=data_start)
