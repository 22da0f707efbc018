"""Plan and write a synthetic GGUF file.

The GGUF layout is written directly: `gguf.GGUFWriter` packs metadata one value at a time (seconds for a
262k-token vocabulary) and wants each tensor whole in memory (a 256-expert tensor is gigabytes). Tensor data
is streamed tensor by tensor in pieces of at most 8 MiB, 32-byte aligned, copied from pools of random blocks
(tandem.synth.blocks), so a large file is written at the disk's speed with little CPU. The file appears
under its final name only when complete (temporary name + rename).
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from tandem.errors import os_reason
from tandem.synth.blocks import BlockPool, small_values
from tandem.synth.layout import TensorSpec, metadata, tensors
from tandem.synth.presets import Preset, SynthError, get_preset
from tandem.synth.quantmix import MIXES, check_mix, choose_types, tensor_nbytes
from tandem.synth.routing import (
    ROUTER_BIAS_SUFFIX,
    LayerFit,
    RoutingSpec,
    calibrate_routers,
    offset_embeddings,
    parse_routing,
)
from tandem.synth.vocab import tokenizer_metadata

ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT


class OutputExistsError(SynthError):
    """The output file exists and --overwrite was not given."""


@dataclass(frozen=True)
class PlannedTensor:
    spec: TensorSpec
    qtype: Q
    nbytes: int


@dataclass(frozen=True)
class SynthPlan:
    """Everything that goes into the file except the random bytes."""

    preset: Preset
    n_layers: int
    mix: str
    metadata: dict[str, Any]
    tensors: list[PlannedTensor]
    routing: RoutingSpec = RoutingSpec()

    @property
    def data_bytes(self) -> int:
        """Size of the tensor-data section (each tensor padded to the alignment)."""
        return sum(_pad(t.nbytes) for t in self.tensors)

    @property
    def n_params(self) -> int:
        """Parameters of the model (every tensor's values)."""
        return sum(t.spec.n_elements for t in self.tensors)


@dataclass(frozen=True)
class SynthResult:
    path: Path
    plan: SynthPlan
    file_bytes: int
    seconds: float
    header_bytes: int
    routing: tuple[LayerFit, ...] = ()  # with skewed routing: each layer's target and fitted expert popularity


def _pad(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan_model(
    like: str | Preset, layers: int | None = None, quant: str = "Q4_K_M", routing: str | RoutingSpec = "uniform"
) -> SynthPlan:
    """The plan of a synthetic model: preset, layer count (default: the real one), quant mix (Q4_K_M/Q8_0/F16),
    routing (`uniform`: the random routers; `zipf:S`, `zipf:S,drift:P`: fitted after writing, tandem.synth.routing)."""
    p = get_preset(like) if isinstance(like, str) else like
    spec = parse_routing(routing) if isinstance(routing, str) else routing
    n_layers = p.check_layers(layers)
    mix = check_mix(quant)
    specs = tensors(p, n_layers)
    types = choose_types(specs, mix, n_layers, p.expert_qtype)
    planned = [PlannedTensor(s, q, tensor_nbytes(s, q)) for s, q in zip(specs, types, strict=True)]
    md: dict[str, Any] = {
        "general.type": "model",
        "general.name": f"synthetic {p.name}",
        "general.description": f"tandem synth: random weights with the shapes of {p.name} ({p.source})",
        "general.file_type": int(MIXES[mix][1]),
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
        **({"tandem.synth.routing": str(spec)} if spec.skewed else {}),
        **metadata(p, n_layers),
        **tokenizer_metadata(p),
    }
    return SynthPlan(preset=p, n_layers=n_layers, mix=mix, metadata=md, tensors=planned, routing=spec)


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _string_array(values: Sequence[str]) -> bytes:
    """Length-prefixed UTF-8 strings, packed with numpy: a 262k-token vocabulary in milliseconds."""
    encoded = [v.encode("utf-8") for v in values]
    lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    out = np.empty(8 * len(encoded) + blob.size, dtype=np.uint8)
    starts = 8 * np.arange(len(encoded)) + np.concatenate(([0], np.cumsum(lens)[:-1]))  # of each length field
    out[np.arange(blob.size) + 8 * (np.repeat(np.arange(len(encoded)), lens) + 1)] = blob
    for k in range(8):  # little-endian uint64 lengths, one byte plane at a time
        out[starts + k] = (lens >> (8 * k)) & 0xFF
    return out.tobytes()


def _value(value: Any) -> bytes:
    """A metadata value with its type tag (int -> uint32, float -> float32, lists of one element type)."""
    T = GGUFValueType
    if isinstance(value, bool):
        return struct.pack("<I?", T.BOOL, value)
    if isinstance(value, int):
        return struct.pack("<II", T.UINT32, value)
    if isinstance(value, float):
        return struct.pack("<If", T.FLOAT32, value)
    if isinstance(value, str):
        return struct.pack("<I", T.STRING) + _string(value)
    head = struct.pack("<I", T.ARRAY)
    if value and isinstance(value[0], str):
        return head + struct.pack("<IQ", T.STRING, len(value)) + _string_array(value)
    if value and isinstance(value[0], bool):
        return head + struct.pack("<IQ", T.BOOL, len(value)) + np.asarray(value, dtype=np.bool_).tobytes()
    if value and isinstance(value[0], float):
        return head + struct.pack("<IQ", T.FLOAT32, len(value)) + np.asarray(value, dtype="<f4").tobytes()
    # integer arrays are int32, as llama.cpp's converter writes token types, head counts and rope sections
    return head + struct.pack("<IQ", T.INT32, len(value)) + np.asarray(value, dtype="<i4").tobytes()


def encode_header(arch: str, md: dict[str, Any], planned: list[PlannedTensor]) -> bytes:
    """Magic, version, metadata and tensor table, zero-padded to the data alignment."""
    kv = {"general.architecture": arch, **md}
    parts = [struct.pack("<IIQQ", gguf.GGUF_MAGIC, gguf.GGUF_VERSION, len(planned), len(kv))]
    parts += [_string(k) + _value(v) for k, v in kv.items()]
    offset = 0
    for t in planned:
        ne = tuple(reversed(t.spec.shape))  # ggml order: the row first
        parts.append(_string(t.spec.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.qtype, offset))
        offset += _pad(t.nbytes)
    header = b"".join(parts)
    return header + bytes(_pad(len(header)) - len(header))


def _chunks(
    t: PlannedTensor, seed: int, index: int, pools: dict[Q, BlockPool], zero_router_bias: bool = False
) -> Iterator[np.ndarray]:
    """The bytes of tensor `t`, the `index`-th of the file: fresh values for F32, else pieces of a pool."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, index])))
    if zero_router_bias and t.spec.name.endswith(ROUTER_BIAS_SUFFIX):  # a fitted router is the whole bias
        yield np.zeros(t.spec.n_elements, dtype=np.float32)
        return
    if t.qtype == Q.F32:  # norms, biases, router, special arrays: small, and their values matter
        yield small_values(t.spec, rng)
        return
    if t.qtype not in pools:
        pools[t.qtype] = BlockPool(t.qtype, np.random.PCG64(np.random.SeedSequence([seed, 1 << 20, t.qtype])))
    yield from pools[t.qtype].take(t.nbytes, rng)


def _write_data(
    fh: IO[bytes], plan: SynthPlan, seed: int, fill: str, progress: Callable[[int, int], None] | None
) -> None:
    done, pools = 0, dict[Q, BlockPool]()
    for index, t in enumerate(plan.tensors):
        if fill == "zeros":
            fh.seek(_pad(t.nbytes), os.SEEK_CUR)  # a hole: reads back as zeros
        else:
            for piece in _chunks(t, seed, index, pools, zero_router_bias=plan.routing.skewed):
                fh.write(memoryview(piece))
            fh.seek(_pad(t.nbytes) - t.nbytes, os.SEEK_CUR)  # padding to the next tensor reads as zeros
        done += _pad(t.nbytes)
        if progress is not None:
            progress(done, plan.data_bytes)


def synthesize(
    like: str | Preset,
    out: str | os.PathLike[str],
    layers: int | None = None,
    quant: str = "Q4_K_M",
    seed: int = 0,
    overwrite: bool = False,
    fill: str = "random",
    progress: Callable[[int, int], None] | None = None,
    routing: str | RoutingSpec = "uniform",
    threads: int | None = None,
) -> SynthResult:
    """Write a random model shaped like preset `like` to `out` and return what was written.

    `fill="zeros"` writes all-zero tensor data as file holes (instant; valid, but every weight is 0) for
    tests that only look at the structure. `progress(done_bytes, total_bytes)` is called after each chunk.
    `routing="zipf:S"` then fits the routers to a Zipf law of expert popularity on one CPU prefill of the written
    model (`threads` ggml threads; tandem.synth.routing) and rewrites them in place.
    Raises SynthError subclasses (unknown preset or mix, bad layer count, existing output, I/O failure).
    """
    if fill not in ("random", "zeros"):
        raise SynthError(f"fill must be 'random' or 'zeros', got {fill!r}")
    plan = plan_model(like, layers, quant, routing)
    if plan.routing.skewed and fill != "random":
        raise SynthError(f"--routing {plan.routing} needs random weights (the routers are fitted on the model's "
                         "hidden states)")  # fmt: skip
    out = Path(out)
    if out.is_dir():
        raise SynthError(f"{out}: is a directory")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out}: already exists (pass --overwrite to replace it)")
    start = time.perf_counter()
    header = encode_header(plan.preset.arch, plan.metadata, plan.tensors)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(header)
            _write_data(fh, plan, seed, fill, progress)
            fh.truncate(len(header) + plan.data_bytes)  # a trailing hole still needs its length
        fits = []
        if plan.routing.skewed:
            offset_embeddings(tmp, seed, plan.routing.phases)
            fits = calibrate_routers(tmp, plan.routing, seed, threads)
        os.replace(tmp, out)
    except BaseException as e:
        with contextlib.suppress(OSError):  # e.g. its folder could not be made: the first error is the one to tell
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # disk full, permissions: one line, like any other synth failure
            raise SynthError(f"{out}: cannot write ({os_reason(e)})") from None
        raise
    size = out.stat().st_size
    return SynthResult(out, plan, size, time.perf_counter() - start, len(header), tuple(fits))
