"""Open a GGUF file, validating everything a loader relies on.

Tensor data stays in the memory map: `TensorInfo.data` is a uint8 view of the file's bytes,
never a copy. Shapes are given in PyTorch order (outermost first); ggml's `ne` is reversed.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from tandem.errors import GGUFFormatError, MissingMetadataError, TandemError, UnsupportedModelError
from tandem.gguf.header import HeaderError, RawTensorEntry, one_line, parse_header, quote

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
        return math.prod(self.shape)


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


@contextmanager
def metadata_errors(path: Path, what: str) -> Iterator[None]:
    """Read `what` (a model's hyper-parameters, its tokenizer) from metadata inside this block: the right keys with
    wrong types or values (a string block count, zero heads, a number where a list belongs) fail in the reader's
    arithmetic, which becomes one line naming the file instead of that arithmetic's traceback."""
    try:
        yield
    except TandemError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, IndexError, KeyError, AttributeError) as e:
        reason = f"{type(e).__name__}: {one_line(str(e))}"
        raise GGUFFormatError(f"{path.name}: malformed {what} metadata ({reason})") from None


def _check_magic(path: Path) -> int:
    """The file's size, once it is known to be a regular file that starts with the GGUF magic. Opened without
    blocking and checked on the open descriptor: a FIFO or device given as the model would block or never end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise GGUFFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GGUFFormatError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as e:
        raise GGUFFormatError(f"{path}: cannot read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise GGUFFormatError(f"{path}: is a directory, not a GGUF file")
        if not stat.S_ISREG(info.st_mode):
            raise GGUFFormatError(f"{path}: not a regular file (a FIFO, socket or device), not a GGUF file")
        magic = os.pread(fd, 4, 0)
    except OSError as e:
        raise GGUFFormatError(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return info.st_size


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file. Raises GGUFFormatError / UnsupportedModelError, one line each."""
    path = Path(path)
    file_size = _check_magic(path)
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        header = parse_header(mapped, file_size)
    except HeaderError as e:
        raise GGUFFormatError(f"{path.name}: malformed or truncated GGUF header: {e}") from None
    data = np.frombuffer(mapped, dtype=np.uint8)  # zero-copy view of the whole file
    tensors = {}
    for entry in header.tensors:
        tensors[entry.name] = _tensor_info(path, entry, header.data_start, data)
    return GGUFFile(path=path, metadata=header.metadata, tensors=tensors, file_size=file_size)


def _tensor_info(path: Path, entry: RawTensorEntry, data_start: int, data: np.ndarray) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(entry.ggml_type)
    except ValueError:
        raise UnsupportedModelError(
            f"{path.name}: tensor {quote(entry.name)} has unknown ggml type {entry.ggml_type}"
        ) from None
    shape = tuple(reversed(entry.ne))
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block != 0:
        raise GGUFFormatError(
            f"{path.name}: tensor {quote(entry.name)}: row of {shape[-1]} is not a multiple of the "
            f"{qtype.name} block of {block}"
        )
    n_bytes = math.prod(shape) // block * type_size  # Python integers: no wrap past 2^64
    offset = data_start + entry.offset
    if offset + n_bytes > data.size:
        raise GGUFFormatError(
            f"{path.name}: tensor {quote(entry.name)} data [{offset}, {offset + n_bytes}) lies beyond the end of "
            f"the file ({data.size} bytes): truncated file?"
        )
    view = data[offset : offset + n_bytes]
    return TensorInfo(name=entry.name, qtype=qtype, shape=shape, data=view, offset=offset)
