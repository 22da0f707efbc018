"""What a comparison runs: the settings both engines share, the placements, and their llama.cpp translation.

A placement is given as tandem's flags (`--device`, `--cpu-moe`, `--n-cpu-moe`, `-ot`, `--gpu-memory`, `--tp`)
and handed to llama.cpp as the same thing in its own terms: `n_gpu_layers` (-1 = every layer on the GPU, 0 =
none) and `tensor_buft_overrides`, written with llama.cpp's own `--cpu-moe`/`--n-cpu-moe` patterns.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from tandem.errors import TandemError
from tandem.placement import PlacementPlan, PlacementRequest

# llama.cpp's patterns (common/common.h LLM_FFN_EXPS_REGEX, common/arg.cpp llm_add_n_cpu_ffn_overrides).
LLAMA_ALL_EXPERTS = r"\.ffn_(up|down|gate_up|gate)_(ch|)exps"
LLAMA_LAYER_EXPERTS = r"blk\.{layer}\.ffn_(up|down|gate_up|gate)_(ch|)exps"


@dataclass(frozen=True)
class Placement:
    """One placement of the matrix, in tandem's flag terms."""

    device: str = "cpu"
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    override_tensor: tuple[str, ...] = ()
    gpu_memory: str | None = None
    tp: int = 1
    n_gpu_layers: int | None = None
    moe_cache: str | None = None  # tandem's expert cache; llama.cpp's row keeps those layers' experts in host RAM
    moe_cache_refresh: int = 0  # tandem's online re-placement of the cache

    def request(self) -> PlacementRequest:
        """The validated request (raises PlacementError, a usage error, for bad flags)."""
        return PlacementRequest.from_flags(
            device=self.device,
            cpu_moe=self.cpu_moe,
            n_cpu_moe=self.n_cpu_moe,
            override_tensor=list(self.override_tensor),
            gpu_memory=self.gpu_memory,
            tp=self.tp,
            n_gpu_layers=self.n_gpu_layers,
            moe_cache=self.moe_cache,
            moe_cache_refresh=self.moe_cache_refresh,
        )

    def argv(self) -> list[str]:
        """The flags that give this placement to `tandem` and to the tandem worker."""
        out = ["--device", self.device]
        if self.cpu_moe:
            out.append("--cpu-moe")
        if self.n_cpu_moe:
            out += ["--n-cpu-moe", str(self.n_cpu_moe)]
        for ot in self.override_tensor:
            out.append(f"--override-tensor={ot}")  # '=' form: a regex may start with '-'
        if self.gpu_memory is not None:
            out += ["--gpu-memory", self.gpu_memory]
        if self.moe_cache is not None:
            out += ["--moe-cache", self.moe_cache]
        if self.moe_cache_refresh:
            out += ["--moe-cache-refresh", str(self.moe_cache_refresh)]
        if self.tp != 1:
            out += ["--tp", str(self.tp)]
        return out  # not -ngl: checked by request(), it has no effect once the device is resolved

    @property
    def label(self) -> str:
        """A short name for tables: the device, then the flags that move tensors."""
        flags = self.argv()[2:]
        if not flags:
            return f"{self.device} (all)" if self.device != "cpu" else "cpu"
        return f"{self.device} " + " ".join(flags)


@dataclass(frozen=True)
class LlamaPlacement:
    """The llama.cpp side of a placement: layers on the GPU and (pattern, buffer) overrides, first match wins."""

    n_gpu_layers: int
    main_gpu: int = 0
    overrides: tuple[tuple[str, str], ...] = ()  # (regex, "cpu" | "cuda:K")

    def as_dict(self) -> dict[str, Any]:
        return {"n_gpu_layers": self.n_gpu_layers, "main_gpu": self.main_gpu, "overrides": list(self.overrides)}


def _gpu_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def to_llama(req: PlacementRequest, plan: PlacementPlan | None = None) -> LlamaPlacement:
    """Translate a tandem placement into llama.cpp's terms, in the order llama.cpp itself applies flags.

    -ot entries come first (as in tandem's plan, where -ot wins over --cpu-moe), then --cpu-moe's pattern or
    --n-cpu-moe's per-layer patterns. --gpu-memory, which llama.cpp lacks, becomes the per-layer patterns of
    the expert layers that tandem's plan put on the CPU to fit the budget.
    """
    if req.tp > 1:
        raise TandemError(f"--tp {req.tp}: no llama.cpp translation (tandem splits tensors, llama.cpp layers)")
    on_gpu = req.device != "cpu"
    overrides: list[tuple[str, str]] = [(pattern, device) for pattern, device in req.override_tensor]
    layers: list[int] = []
    if req.cpu_moe:
        overrides.append((LLAMA_ALL_EXPERTS, "cpu"))
    else:
        layers = list(range(req.n_cpu_moe))
    if req.gpu_memory is not None and plan is not None and not req.cpu_moe:
        layers += [i for i in plan.cpu_expert_layers if i not in layers]
    overrides += [(LLAMA_LAYER_EXPERTS.format(layer=i), "cpu") for i in layers]
    return LlamaPlacement(
        n_gpu_layers=-1 if on_gpu else 0,
        main_gpu=_gpu_index(req.device) if on_gpu else 0,
        overrides=tuple(overrides),
    )


_MATRIX_ITEM = re.compile(r"^(?:(?P<all>all|gpu)|(?P<cpumoe>cpu-moe)|n-cpu-moe[=:](?P<n>\d+|half))$")


def parse_matrix(text: str, base: Placement, n_layers: int) -> list[Placement]:
    """'cpu-moe,n-cpu-moe=half,all' -> placements that differ from `base` only in where the experts go.

    all (or gpu): every expert on --device; cpu-moe: every expert on the CPU; n-cpu-moe=N: the experts of
    layers 0..N-1 on the CPU, N=half meaning n_layers // 2 of this model.
    """
    out: list[Placement] = []
    for item in (s.strip() for s in text.split(",")):
        m = _MATRIX_ITEM.match(item)
        if not m:
            raise TandemError(f"--matrix: cannot read '{item}' (use all, cpu-moe, n-cpu-moe=N or n-cpu-moe=half)")
        if m.group("all"):
            out.append(Placement(**{**asdict(base), "cpu_moe": False, "n_cpu_moe": 0}))
        elif m.group("cpumoe"):
            out.append(Placement(**{**asdict(base), "cpu_moe": True, "n_cpu_moe": 0}))
        else:
            n = n_layers // 2 if m.group("n") == "half" else int(m.group("n"))
            out.append(Placement(**{**asdict(base), "cpu_moe": False, "n_cpu_moe": n}))
    return out


@dataclass(frozen=True)
class BenchSettings:
    """What both engines get alike."""

    model: str
    threads: int
    pp: tuple[int, ...]
    tg: int
    reps: int
    n_ctx: int
    n_batch: int
    cache_type: str = "f16"
    timeout_s: float = 1800.0  # per repetition; the first also counts start, load, warm-up (compare.py)
    budget_s: float | None = None  # all the worker processes together
    dtype: str | None = None  # tandem's --dtype (GPU compute type), passed through when given
    process_reps: int | None = None  # repetitions per worker process (None: the reps in two processes per engine)
    repack_experts: bool | None = None  # tandem's --repack-experts / --no-repack-experts (None: its default)
    pcie_experts: int = 0  # tandem's --pcie-experts (llama.cpp computes every --cpu-moe expert on the CPU in decode)
    expert_stats: str | None = None  # tandem's --expert-stats: each tandem worker reads and adds to the file
    seed: int = 0  # the first repetition's prompt seed (repetition r: seed + r)

    def process_plan(self, n_engines: int) -> list[int]:
        """Repetitions of each of a row's worker processes, in order (compare.py's schedule): `process_reps` each
        (the last one the rest); by default, with two engines and more than one repetition, half of them rounded
        up and then the rest (two processes); else all of them in one."""
        per = self.process_reps or (-(-self.reps // 2) if n_engines > 1 else self.reps)
        return [min(per, self.reps - done) for done in range(0, self.reps, per)]

    def validate(self) -> None:
        """Raise TandemError (a usage error) for sizes no run could use."""
        if not self.pp or min(self.pp) <= 0 or self.tg <= 0 or self.reps <= 0:
            raise TandemError("--pp, --tg and --reps must be positive")
        if max(self.pp) + self.tg > self.n_ctx:
            raise TandemError(f"--pp {max(self.pp)} + --tg {self.tg} exceed the context size {self.n_ctx} (-c)")
        for flag, seconds in (("--timeout", self.timeout_s), ("--budget", self.budget_s)):
            if seconds is not None and not 0 < seconds < math.inf:  # nan fails this too
                raise TandemError(f"{flag} must be a positive number of seconds, got {seconds:g}")
        if self.threads <= 0:
            raise TandemError("-t/--threads must be positive")
        if self.process_reps is not None and self.process_reps <= 0:
            raise TandemError("--process-reps must be positive")
