"""Open a GGUF file through the `gguf` package, validating everything a loader relies on.

Tensor data stays in the memory map: `TensorInfo.data` is a uint8 view of the file's bytes,
never a copy. Shapes are given in PyTorch order (outermost first); ggml's `ne` is reversed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from tandem.errors import GGUFFormatError, MissingMetadataError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: name, ggml type, PyTorch-order shape and its raw bytes (mmap view)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, len == n_bytes, a view into the memory map
    offset: int  # absolute byte offset in the file

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class GGUFFile:
    """Metadata and tensors of one GGUF file."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    file_size: int

    @property
    def arch(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise MissingMetadataError(f"{self.path.name}: required metadata key '{key}' is missing")
        return self.metadata[key]

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    def arch_require(self, suffix: str) -> Any:
        return self.require(f"{self.arch}.{suffix}")


def _field_value(field: Any) -> Any:
    """Decode one reader field to a Python value (arrays of strings/numbers become lists)."""
    main_type = field.types[0] if field.types else None
    if main_type == GGUFValueType.ARRAY:
        sub_type = field.types[1] if len(field.types) > 1 else None
        if sub_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        values = [field.parts[i] for i in field.data]
        if not values:
            return []
        return np.concatenate(values).tolist()
    if main_type == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]]
    return value.item() if value.size == 1 else value.tolist()


def _check_magic(path: Path) -> int:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise GGUFFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GGUFFormatError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as e:
        raise GGUFFormatError(f"{path}: cannot read ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return size


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file. Raises GGUFFormatError / UnsupportedModelError, one line each."""
    path = Path(path)
    file_size = _check_magic(path)
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, EOFError, OverflowError, KeyError, TypeError, MemoryError) as e:
        raise GGUFFormatError(f"{path.name}: malformed or truncated GGUF header ({_short(e)})") from None
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        tensors[t.name] = _tensor_info(path, reader, t, file_size)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, file_size=file_size)


def _tensor_info(path: Path, reader: GGUFReader, t: Any, file_size: int) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(int(t.tensor_type))
    except ValueError:
        raise UnsupportedModelError(f"{path.name}: tensor '{t.name}' has unknown ggml type {int(t.tensor_type)}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_elements = int(np.prod(shape)) if shape else 1
    if shape and shape[-1] % block != 0:
        raise GGUFFormatError(
            f"{path.name}: tensor '{t.name}' row of {shape[-1]} is not a multiple of the {qtype.name} block"
        )
    n_bytes = n_elements // block * type_size
    offset = int(t.data_offset)
    if offset + n_bytes > file_size:
        raise GGUFFormatError(
            f"{path.name}: tensor '{t.name}' data [{offset}, {offset + n_bytes}) lies beyond the end of "
            f"the file ({file_size} bytes): truncated file?"
        )
    data = reader.data[offset : offset + n_bytes]
    return TensorInfo(name=t.name, qtype=qtype, shape=shape, data=data, offset=offset)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
