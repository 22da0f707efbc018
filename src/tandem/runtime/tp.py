"""Tensor-parallel execution (`--tp N`): the ranks' processes, their groups, and the step protocol.

Rank 0 is the process that loads the model (`tandem.LLM(..., tp=N)`, `tandem run --tp N`); it starts ranks 1..N-1 as
child processes (`python -m tandem.runtime.tp_worker`), which meet it at a TCPStore on 127.0.0.1. Each rank loads its
own slices (placement/tp.py, weights/tp.py) and builds the ordinary model from them, whose blocks all-reduce their
partial outputs over the data group (NCCL between GPUs, gloo between CPU ranks). Rank 0 keeps the scheduler, the
samplers and everything above; its runner (`TPRunner`) broadcasts every step on the control group (gloo) before
running it, and the other ranks run the same step (`serve_steps`). docs/TENSOR_PARALLEL.md explains the design.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tandem.errors import PlacementError, TandemError
from tandem.gguf import GGUFFile, open_gguf
from tandem.models import architecture, read_config
from tandem.models.config import ModelConfig
from tandem.models.decoder import DecoderModel
from tandem.placement import PlacementRequest, RuntimeShape
from tandem.placement.tp import RankPlan, TensorParallelPlan, check_tp_flags, plan_tensor_parallel
from tandem.quant.ggml_cpu import CPUKernels
from tandem.runtime.devices import DTYPES
from tandem.runtime.runner import ModelRunner
from tandem.state.kv_cache import CACHE_DTYPES
from tandem.state.pool import StatePool
from tandem.weights.tp import RankLoader

DATA_TIMEOUT = datetime.timedelta(minutes=30)  # an all-reduce waiting this long means a rank is gone
CONTROL_TIMEOUT = datetime.timedelta(days=365)  # the other ranks wait for rank 0's next step as long as it lives
STORE_TIMEOUT = datetime.timedelta(minutes=30)

STOP, STEP, REPORT = 0, 1, 2  # control messages


@dataclass(frozen=True)
class RankOptions:
    """What every rank needs to make its plan and load its part: the model and the LLM's options, as given (the
    plan is computed the same way on every rank)."""

    path: str
    device: str
    tp: int
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    override_tensor: tuple[str, ...] = ()
    gpu_memory: int | None = None
    n_gpu_layers: int | None = None
    n_ctx: int = 4096
    n_batch: int = 512
    n_parallel: int = 1
    cache_type: str = "f16"
    dtype: str | None = None
    repack_experts: bool = False

    def request(self) -> PlacementRequest:
        return PlacementRequest.from_flags(
            device=self.device, cpu_moe=self.cpu_moe, n_cpu_moe=self.n_cpu_moe,
            override_tensor=list(self.override_tensor), gpu_memory=self.gpu_memory, tp=self.tp,
            n_gpu_layers=self.n_gpu_layers,
        )  # fmt: skip

    def shape(self) -> RuntimeShape:
        return RuntimeShape(
            n_ctx=self.n_ctx, n_batch=self.n_batch, cache_bytes_per_value=CACHE_DTYPES[self.cache_type].itemsize,
            n_seq=self.n_parallel,
        )  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankOptions:
        values = json.loads(text)
        values["override_tensor"] = tuple(values["override_tensor"])
        return cls(**values)


def check_tensor_parallel(req: PlacementRequest, pcie_experts: int = 0) -> None:
    """What this machine and build need for --tp N, before anything loads (one line naming the flag)."""
    n = req.tp
    check_tp_flags(req, pcie_experts)
    if not dist.is_available() or not dist.is_gloo_available():
        raise PlacementError(f"--tp {n}: this torch build has no torch.distributed with gloo")
    if req.device == "cpu":
        return
    first = int(req.device.split(":")[1])
    if not torch.cuda.is_available():
        raise PlacementError(f"--tp {n} --device {req.device}: no CUDA device is visible; use --device cpu")
    count = torch.cuda.device_count()
    if first + n > count:
        raise PlacementError(
            f"--tp {n}: ranks on cuda:{first}..cuda:{first + n - 1} need {n} GPUs from cuda:{first}, {count} visible"
        )
    if not getattr(dist, "is_nccl_available", lambda: False)():
        raise PlacementError(f"--tp {n}: this torch build has no NCCL for the GPUs' all-reduces")


# -- groups -------------------------------------------------------------------------------------------------------


class TPGroup:
    """The ranks' store and their two process groups (made directly, not torch's default group, so that a program
    using tandem.LLM keeps torch.distributed to itself): control (gloo: rank 0's steps) and data (the all-reduces)."""

    def __init__(self, rank: int, size: int, store: dist.Store) -> None:
        self.rank, self.size, self.store = rank, size, store
        self.control: dist.ProcessGroup | None = None
        self.data: dist.ProcessGroup | None = None
        self._reports = 0

    @classmethod
    def serve(cls, size: int) -> TPGroup:
        """Rank 0: the store, on a free port of 127.0.0.1."""
        return cls(0, size, dist.TCPStore("127.0.0.1", 0, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False))

    @classmethod
    def join(cls, rank: int, size: int, port: int) -> TPGroup:
        return cls(rank, size, dist.TCPStore("127.0.0.1", port, size, False, timeout=STORE_TIMEOUT))

    @property
    def port(self) -> int:
        assert isinstance(self.store, dist.TCPStore)
        return int(self.store.port)

    def connect(self, backend: str) -> None:
        """Make both groups: every rank calls this once it has loaded (it waits for the others)."""
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), self.rank, self.size,
                                             CONTROL_TIMEOUT)  # fmt: skip
        data_store = dist.PrefixStore("data", self.store)
        if backend == "nccl":
            nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]
            try:
                self.data = nccl(data_store, self.rank, self.size, DATA_TIMEOUT)
            except TypeError:  # builds whose constructor takes options only
                self.data = nccl(data_store, self.rank, self.size)
        else:
            self.data = dist.ProcessGroupGloo(data_store, self.rank, self.size, DATA_TIMEOUT)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, on every rank (the same values)."""
        assert self.data is not None, "all_reduce before connect"
        x = x.contiguous()
        self.data.allreduce([x]).wait()
        return x

    # -- control messages (rank 0 sends, the others receive) --
    def send(self, kind: int, payload: list[int] = ()) -> None:  # type: ignore[assignment]
        assert self.control is not None and self.rank == 0
        self.control.broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64), 0).wait()
        if payload:
            self.control.broadcast(torch.tensor(payload, dtype=torch.int64), 0).wait()

    def receive(self) -> tuple[int, list[int]]:
        assert self.control is not None and self.rank != 0
        head = torch.zeros(2, dtype=torch.int64)
        self.control.broadcast(head, 0).wait()
        kind, n = int(head[0]), int(head[1])
        payload = torch.zeros(n, dtype=torch.int64)
        if n:
            self.control.broadcast(payload, 0).wait()
        return kind, payload.tolist()

    def reports(self, own: dict[str, object]) -> list[dict[str, object]]:
        """Every rank's status (`rank_report`), rank 0's given: asked for on the control group, read from the store."""
        self.send(REPORT, [self._reports])
        keys = [f"report/{r}/{self._reports}" for r in range(1, self.size)]
        self._reports += 1
        return [own, *(json.loads(self.store.get(key)) for key in keys)]

    def fail(self, message: str) -> None:
        """A rank other than 0 gives up: its error for rank 0 to raise."""
        self.store.set(f"error/{self.rank}", message)

    def errors(self) -> list[str]:
        keys = [f"error/{r}" for r in range(1, self.size)]
        return [f"rank {r}: {self.store.get(k).decode()}" for r, k in enumerate(keys, 1) if self.store.check([k])]


# -- steps --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotStep:
    """A slot's piece of a step as rank 0 runs it: where its cache is before the step and what it computes."""

    slot: int
    length: int  # the slot's positions before the step
    checkpoints: tuple[int, ...]  # the lengths of its recurrent checkpoints, oldest first
    tokens: tuple[int, ...]


def encode_step(pieces: Sequence[SlotStep], all_logits: bool) -> list[int]:
    out = [int(all_logits), len(pieces)]
    for p in pieces:
        out += [p.slot, p.length, len(p.checkpoints), *p.checkpoints, len(p.tokens), *p.tokens]
    return out


def decode_step(payload: list[int]) -> tuple[list[SlotStep], bool]:
    all_logits, n = bool(payload[0]), payload[1]
    at, pieces = 2, []
    for _ in range(n):
        slot, length, n_ckpt = payload[at : at + 3]
        at += 3
        checkpoints = tuple(payload[at : at + n_ckpt])
        at += n_ckpt
        n_tokens = payload[at]
        tokens = tuple(payload[at + 1 : at + 1 + n_tokens])
        at += 1 + n_tokens
        pieces.append(SlotStep(slot, length, checkpoints, tokens))
    return pieces, all_logits


def follow(pool: StatePool, piece: SlotStep) -> None:
    """Make this rank's slot what rank 0's was before the step: cut to its length (the same `truncate`, which for
    recurrent layers goes back to the same checkpoint) and take the checkpoint rank 0 took; a slot that cannot agree
    is an error, not a wrong answer."""
    cache = pool.caches[piece.slot]
    if cache.length != piece.length:
        cache.truncate(piece.length)
    if piece.length in piece.checkpoints and all(at != piece.length for at, _ in cache.checkpoints):
        cache.checkpoint()
    held = tuple(at for at, _ in cache.checkpoints)
    if cache.length != piece.length or held != piece.checkpoints:
        raise TandemError(
            f"slot {piece.slot} is out of step with rank 0: {cache.length} positions and checkpoints {held}, rank 0 "
            f"{piece.length} and {piece.checkpoints}"
        )


class TPRunner(ModelRunner):
    """Rank 0's runner under --tp: each step is broadcast to the other ranks, then run here as they run it. A step
    that fails after it was sent leaves the ranks out of step: every later step is refused."""

    def __init__(self, model: DecoderModel, pool: StatePool, ranks: Ranks) -> None:
        super().__init__(model, pool, graphs=False)
        self.ranks = ranks
        self.broken: str | None = None

    def run(self, pieces: Sequence[tuple[int, Sequence[int]]], all_logits: bool = False) -> torch.Tensor:
        if self.broken is not None:
            raise TandemError(f"--tp: the ranks are out of step since an earlier error ({self.broken}); reload")
        steps = []
        for slot, tokens in pieces:  # what the step would refuse, refused before anything is sent
            cache = self.pool.caches[slot]
            cache.check_room(len(tokens))
            cache.check_order()
            steps.append(SlotStep(slot, cache.length, tuple(at for at, _ in cache.checkpoints), tuple(tokens)))
        try:
            self.ranks.group.send(STEP, encode_step(steps, all_logits))
            return super().run(pieces, all_logits)
        except BaseException as e:
            failed = self.ranks.failures()
            self.broken = "; ".join(failed) or f"{type(e).__name__}: {e}"
            if failed:
                raise TandemError(f"--tp {self.ranks.group.size}: {self.broken}") from None
            raise


def serve_steps(group: TPGroup, runner: ModelRunner, report: dict[str, object]) -> None:
    """The loop of a rank other than 0: run each step rank 0 sends, answer its reports, until it says stop."""
    while True:
        kind, payload = group.receive()
        if kind == STOP:
            return
        if kind == REPORT:
            group.store.set(f"report/{group.rank}/{payload[0]}", json.dumps({**report, **gpu_memory_of(runner.model)}))
            continue
        pieces, all_logits = decode_step(payload)
        for piece in pieces:
            follow(runner.pool, piece)
        runner.run([(p.slot, list(p.tokens)) for p in pieces], all_logits)


# -- loading a rank -----------------------------------------------------------------------------------------------


@dataclass
class LoadedRank:
    """A rank's model and what loading it left: its kernels (thread pool), placement read back, uploads, notices."""

    plan: RankPlan
    model: DecoderModel
    kernels: CPUKernels
    placed: dict[str, str]
    uploaded: list[str]
    notices: list[str] = field(default_factory=list)

    def report(self) -> dict[str, object]:
        return {"rank": self.plan.rank, "device": self.plan.device, "placed": self.placed, "uploaded": self.uploaded}


def open_plan(options: RankOptions) -> tuple[GGUFFile, ModelConfig, TensorParallelPlan]:
    f = open_gguf(options.path)
    cfg = read_config(f)
    return f, cfg, plan_tensor_parallel(f, cfg, options.request(), options.shape())


def load_rank(rank_plan: RankPlan, f: GGUFFile, options: RankOptions, threads: int, group: TPGroup) -> LoadedRank:
    """Load this rank's slices where its plan puts them and build its model, whose blocks reduce over `group`."""
    if rank_plan.device != "cpu":
        torch.cuda.set_device(rank_plan.device)
    kernels = CPUKernels(threads)
    torch.set_num_threads(threads)
    loader = RankLoader(rank_plan.load_view(), rank_plan.plan, kernels, rank_plan.expert_ranges,
                        DTYPES[options.dtype or "bf16"], repack_experts=options.repack_experts)  # fmt: skip
    model = DecoderModel(rank_plan.config, loader, architecture(f).build_block, group.all_reduce)
    return LoadedRank(rank_plan, model, kernels, loader.placed(), loader.uploaded, loader.notices())


def new_rank_pool(model: DecoderModel, options: RankOptions) -> StatePool:
    """The state pool every rank makes alike (the Engine's, on rank 0)."""
    return model.new_pool(options.n_parallel, options.n_ctx, CACHE_DTYPES[options.cache_type], options.n_batch)


# -- rank 0's handle on the others ----------------------------------------------------------------------------------


class Ranks:
    """Ranks 1..N-1 as rank 0 sees them: their processes and the group."""

    def __init__(self, group: TPGroup, processes: list[subprocess.Popen[bytes]]) -> None:
        self.group = group
        self.processes = processes
        self.reports: list[dict[str, object]] = []  # each one's report at load (rank 1 first)

    @classmethod
    def start(cls, options: RankOptions, cores: list[list[int]], threads: int | None) -> Ranks:
        """Start the store and ranks 1..N-1, each pinned to its cores."""
        group = TPGroup.serve(options.tp)
        processes = []
        for rank in range(1, options.tp):
            argv = [sys.executable, "-m", "tandem.runtime.tp_worker", str(rank), str(options.tp), str(group.port),
                    ",".join(map(str, cores[rank])), str(threads or 0), options.to_json()]  # fmt: skip
            processes.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return cls(group, processes)

    def failures(self) -> list[str]:
        """What went wrong with the other ranks: the errors they wrote, else those that ended."""
        errors = self.group.errors()
        ended = [f"rank {r}: exited with code {p.returncode}" for r, p in enumerate(self.processes, 1)
                 if p.poll() is not None]  # fmt: skip
        return errors or ended

    def wait_loaded(self) -> None:
        """Until every rank has loaded (its report in the store), or one failed (its error raised, one line)."""
        pending = set(range(1, self.group.size))
        while pending:
            for rank in sorted(pending):
                if self.group.store.check([f"ready/{rank}"]):
                    pending.discard(rank)
                elif self.processes[rank - 1].poll() is not None:
                    raise TandemError(f"--tp {self.group.size}: {self.failures()[0]}")
            time.sleep(0.02)
        self.reports = [json.loads(self.group.store.get(f"ready/{r}")) for r in range(1, self.group.size)]

    def close(self) -> None:
        """Tell the ranks to stop and wait for them when they are connected; kill those that do not end (or, before
        the groups are connected, all of them: they wait for rank 0)."""
        connected = self.group.control is not None
        if connected:
            try:
                self.group.send(STOP)
            except RuntimeError:  # a rank already gone
                pass
        for p in self.processes:
            try:
                p.wait(timeout=10 if connected else 0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __del__(self) -> None:
        for p in getattr(self, "processes", ()):
            if p.poll() is None:
                p.kill()


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent ends (a rank never outlives rank 0)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent ended before the call
        os._exit(1)


# -- rank 0: the whole of it ----------------------------------------------------------------------------------------


@dataclass
class TensorParallel:
    """Rank 0 of a --tp N model: the plan, rank 0's own part, the other ranks, the cores rank 0's process had before
    it was pinned to its own. `runner` is what rank 0's Engine runs steps with."""

    plan: TensorParallelPlan
    rank0: LoadedRank
    ranks: Ranks
    threads: int
    unpinned: set[int]

    @classmethod
    def start(
        cls, f: GGUFFile, cfg: ModelConfig, options: RankOptions, threads: int | None, pcie_experts: int = 0
    ) -> TensorParallel:
        """Plan (every check before anything starts), start ranks 1..N-1, load rank 0's part here, wait for the
        others and connect. Raises a one-line TandemError for a request --tp cannot honour or a rank that failed."""
        from tandem.runtime.devices import check_executable
        from tandem.runtime.tp_cores import host_cpus, pin_process, rank_cores

        request = options.request()
        check_tensor_parallel(request, pcie_experts)
        plan = plan_tensor_parallel(f, cfg, request, options.shape())
        check_executable(plan.ranks[0].plan)
        cores = rank_cores(host_cpus(), plan.size)
        ranks = Ranks.start(options, cores, threads)
        unpinned = pin_process(cores[0])
        try:
            own = threads or len(cores[0])
            rank0 = load_rank(plan.ranks[0], f, options, own, ranks.group)
            ranks.wait_loaded()
            ranks.group.connect(plan.backend)
        except BaseException:
            ranks.close()
            pin_process(sorted(unpinned))
            raise
        return cls(plan=plan, rank0=rank0, ranks=ranks, threads=own, unpinned=unpinned)

    def runner(self, model: DecoderModel, pool: StatePool, graphs: bool) -> ModelRunner:
        return TPRunner(model, pool, self.ranks)

    def reports(self) -> list[dict[str, object]]:
        """Every rank's report now: what it placed and uploaded at load, and (on GPUs) its memory."""
        own = {**self.rank0.report(), **gpu_memory_of(self.rank0.model)}
        return self.ranks.group.reports(own)

    def placement_summary(self) -> dict[str, int]:
        """Bytes of weights per device, read back from every rank's loaded tensors: each GPU its rank's slices; host
        RAM each whole tensor once (the ranks map the same file) and each rank's slices."""
        totals: dict[str, int] = {}
        counted: set[str] = set()
        for report, rank in zip([self.rank0.report(), *self.ranks.reports], self.plan.ranks, strict=True):
            placed = report["placed"]
            assert isinstance(placed, dict)
            for name, device in placed.items():
                whole = rank.cuts[name].how == "whole"
                if device == "cpu" and whole and name in counted:
                    continue
                counted.add(name)
                totals[device] = totals.get(device, 0) + rank.file.tensors[name].n_bytes
        return totals

    def close(self) -> None:
        from tandem.runtime.tp_cores import pin_process

        self.ranks.close()
        self.rank0.kernels.close()
        pin_process(sorted(self.unpinned))


def gpu_memory_of(model: DecoderModel) -> dict[str, object]:
    if model.device.type != "cuda":
        return {}
    device = model.device
    return {"gpu_bytes": torch.cuda.memory_allocated(device), "peak_gpu_bytes": torch.cuda.max_memory_allocated(device)}
