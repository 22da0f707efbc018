"""The placement flags, validated where they are made."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.errors import PlacementError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str, flag: str = "--gpu-memory") -> int:
    """'24GiB', '20GB', '1.5g', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise PlacementError(f"{flag}: cannot read '{text}' as a size (e.g. 24GiB, 20GB, 8000MiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


# A device as --device and -ot name it: cpu, cuda, cuda:K, and llama.cpp's buffer names (CPU, CUDA0, CUDA1, ...).
_DEVICE_RE = re.compile(r"cpu|(?:cuda|gpu)(?::?(\d+))?", re.IGNORECASE)
# An -ot list item's end: llama.cpp's -ot takes 'REGEX=DEVICE,REGEX=DEVICE,...'.
_OVERRIDE_END_RE = re.compile(rf"=\s*(?:{_DEVICE_RE.pattern})\s*$", re.IGNORECASE)


def normalize_device(device: str, flag: str) -> str:
    """'cpu', 'cuda', 'cuda:K', llama.cpp's 'CPU' and 'CUDAK' -> 'cpu' or 'cuda:K'."""
    m = _DEVICE_RE.fullmatch(device.strip())
    if m is None:
        raise PlacementError(f"{flag}: unknown device '{device}' (use cpu, cuda or cuda:K)")
    if m.group(0).lower() == "cpu":
        return "cpu"
    return f"cuda:{int(m.group(1) or 0)}"


def split_overrides(text: str) -> list[str]:
    """llama.cpp's comma-separated -ot list -> its items. A comma inside a regex (`\\d{1,3}`) stays: the text is cut
    only after an item's '=DEVICE'."""
    items, current = [], ""
    for piece in text.split(","):
        current = f"{current},{piece}" if current else piece
        if _OVERRIDE_END_RE.search(current):
            items.append(current)
            current = ""
    return [*items, current] if current or not items else items


def parse_override(text: str) -> tuple[str, str]:
    """'REGEX=DEVICE' (one item of llama.cpp's -ot list) -> (regex, device)."""
    pattern, sep, device = text.rpartition("=")
    if not sep or not pattern:
        raise PlacementError(f"-ot/--override-tensor: expected REGEX=DEVICE, got '{text}'")
    try:
        re.compile(pattern)
    except re.error as e:
        raise PlacementError(f"-ot/--override-tensor: bad regex '{pattern}': {e}") from None
    return pattern, normalize_device(device, "-ot/--override-tensor")


@dataclass(frozen=True)
class PlacementRequest:
    """What the user asked for: --device, --cpu-moe, --n-cpu-moe, -ot, --gpu-memory, --tp, -ngl, --moe-cache."""

    device: str = "cpu"
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    override_tensor: tuple[tuple[str, str], ...] = ()
    gpu_memory: int | None = None
    tp: int = 1
    # llama.cpp's -ngl, accepted for its command lines: tandem keeps the layers on one device (the model's
    # layer count or more, or < 0: the GPU; 0: the CPU); plan_placement refuses a split.
    n_gpu_layers: int | None = None
    moe_cache: int | None = None  # bytes of VRAM for single experts of the layers kept in host RAM (--moe-cache)
    moe_cache_refresh: int = 0  # decode steps between online re-placements of cached experts (0: the start's stay)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", normalize_device(self.device, "--device"))
        if self.n_cpu_moe < 0:
            raise PlacementError(f"--n-cpu-moe must be >= 0, got {self.n_cpu_moe}")
        if self.cpu_moe and self.n_cpu_moe:
            raise PlacementError(
                "--cpu-moe and --n-cpu-moe are exclusive: --cpu-moe already puts every layer's experts on the CPU"
            )
        if self.gpu_memory is not None and self.gpu_memory <= 0:
            raise PlacementError(f"--gpu-memory must be positive, got {self.gpu_memory}")
        if self.tp < 1:
            raise PlacementError(f"--tp must be >= 1, got {self.tp}")
        if self.device == "cpu" and self.gpu_memory is not None:
            raise PlacementError("--gpu-memory needs a GPU device (--device cuda)")
        if self.n_gpu_layers == 0 and self.device != "cpu":
            raise PlacementError(f"-ngl 0 keeps every layer on the CPU, which --device {self.device} contradicts")
        if self.n_gpu_layers not in (None, 0) and self.device == "cpu":
            raise PlacementError(
                f"-ngl {self.n_gpu_layers} asks for the layers on a GPU, but the device is cpu "
                "(no GPU visible, or --device cpu): use --device cuda, or -ngl 0"
            )
        if self.moe_cache is not None and self.moe_cache <= 0:
            raise PlacementError(f"--moe-cache must be positive, got {self.moe_cache}")
        if self.device == "cpu" and self.moe_cache is not None:
            raise PlacementError("--moe-cache keeps experts in VRAM: it needs a GPU device (--device cuda)")
        if self.moe_cache_refresh < 0:
            raise PlacementError(f"--moe-cache-refresh must be >= 0 (0: off), got {self.moe_cache_refresh}")
        if self.moe_cache_refresh and self.moe_cache is None and self.gpu_memory is None:
            raise PlacementError("--moe-cache-refresh re-places cached experts: give --moe-cache SIZE or --gpu-memory")

    @classmethod
    def from_flags(
        cls,
        device: str = "cpu",
        cpu_moe: bool = False,
        n_cpu_moe: int = 0,
        override_tensor: list[str] | tuple[str, ...] | None = None,
        gpu_memory: str | int | None = None,
        tp: int = 1,
        n_gpu_layers: int | None = None,
        moe_cache: str | int | None = None,
        moe_cache_refresh: int = 0,
    ) -> PlacementRequest:
        """Build from CLI/API values (override strings 'REGEX=DEVICE', sizes as text or bytes)."""
        overrides = tuple(parse_override(item) for o in (override_tensor or ()) for item in split_overrides(o))
        budget = parse_size(gpu_memory) if isinstance(gpu_memory, str) else gpu_memory
        cache = parse_size(moe_cache, "--moe-cache") if isinstance(moe_cache, str) else moe_cache
        return cls(
            device=device, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, override_tensor=overrides, gpu_memory=budget, tp=tp,
            n_gpu_layers=n_gpu_layers, moe_cache=cache, moe_cache_refresh=moe_cache_refresh,
        )  # fmt: skip

    @property
    def uses_gpu(self) -> bool:
        return self.device != "cpu" or any(d != "cpu" for _, d in self.override_tensor)
