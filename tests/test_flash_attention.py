"""tandem's CPU flash attention (tandem.quant.flash_attention): bit for bit ggml's flash-attention node on every
shape it takes (a decode row over 512 keys and more, 64 query rows and more), thread count, mask and sinks; the shapes
it leaves to ggml; the step graphs' logits unchanged with it."""

from __future__ import annotations

import ctypes
import itertools

import ggml
import numpy as np
import pytest

import tandem
from tandem.api import default_model_path
from tandem.errors import TandemError
from tandem.models.cpu_graph import FLASH_ENV
from tandem.quant import flash_attention

kernel_here = pytest.mark.skipif(
    not flash_attention.available()[0], reason=f"not used here: {flash_attention.available()[1]}"
)


class Case:
    """q [D, 1, H], keys and values [D, n, G] (f16), an f16 mask row, sinks [H] in one ggml context with data."""

    def __init__(self, d: int, heads: int, groups: int, n: int, mask: str, seed: int = 0, rows: int = 1) -> None:
        # the inputs, and the outputs of up to 4 runs of both nodes (ggml aborts the process past its pool)
        size = (64 << 20) + 4 * d * n * groups + 2 * rows * n + 4 * rows * d * heads * (1 + 8)
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        rng = np.random.default_rng(seed)
        row = np.zeros((rows, n), np.float16)
        causal = np.arange(rows)[:, None] < np.arange(n)[None, :] - (n - rows)  # the last rows' positions
        if mask == "holes":
            row[rng.random((rows, n)) < 0.3] = -np.inf
        elif mask == "window":  # a sliding window: causal, the first half masked, whole tiles and chunks among them
            row[causal] = -np.inf
            row[:, : n // 2] = -np.inf
        elif mask == "tail":  # causal: a cache view past the last position
            row[causal] = -np.inf
            row[:, n - 200 :] = -np.inf
        self.t = {name: self._tensor(a) for name, a in {
            "q": (rng.standard_normal((heads, rows, d)) * 3).astype(np.float32),
            "k": (rng.standard_normal((groups, n, d)) * 2).astype(np.float16),
            "v": rng.standard_normal((groups, n, d)).astype(np.float16),
            "mask": row,
            "sinks": rng.standard_normal(heads).astype(np.float32),
        }.items()}  # fmt: skip
        self.heads, self.d, self.rows = heads, d, rows

    def _tensor(self, a: np.ndarray) -> ggml.ggml_tensor_p:
        gtype = ggml.GGML_TYPE_F32 if a.dtype == np.float32 else ggml.GGML_TYPE_F16
        ne = a.shape[::-1]
        t = getattr(ggml, f"ggml_new_tensor_{len(ne)}d")(self.ctx, gtype, *ne)
        ctypes.memmove(ggml.ggml_get_data(t), a.ctypes.data, a.nbytes)
        return t

    def run(self, node: ggml.ggml_tensor_p, threads: int) -> np.ndarray:
        graph = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(graph, node)
        ggml.ggml_graph_compute_with_ctx(self.ctx, graph, threads)
        pointer = ctypes.cast(ggml.ggml_get_data(node), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(pointer, shape=(self.heads * self.rows * self.d,)).copy()

    def both(self, threads: int, sinks: bool, scale: float = 0.0883883) -> tuple[np.ndarray, np.ndarray]:
        t, keep = self.t, []
        ref = ggml.ggml_flash_attn_ext(self.ctx, t["q"], t["k"], t["v"], t["mask"], scale, 0.0, 0.0)
        if sinks:
            ggml.ggml_flash_attn_ext_add_sinks(ref, t["sinks"])
        sink = t["sinks"] if sinks else None
        out = flash_attention.attention(self.ctx, t["q"], t["k"], t["v"], t["mask"], scale, sink, threads, keep)
        return self.run(ref, threads), self.run(out, threads)

    def close(self) -> None:
        ggml.ggml_free(self.ctx)


@kernel_here
@pytest.mark.parametrize(("d", "heads", "groups"), [(128, 32, 4), (256, 4, 1), (64, 8, 8), (512, 16, 2)])
def test_a_decode_row_bit_for_bit_ggml(d: int, heads: int, groups: int) -> None:
    """Qwen3's, Gemma 3's, gpt-oss's and Gemma 4's global layers' head shapes, over 512 to 3,000 keys, 1 to 5
    threads (ggml's chunks of keys are by the threads' number), masks with holes, a window that empties whole
    chunks and a tail, with and without sinks: every output bit is ggml's."""
    for n, mask in itertools.product((512, 777, 3000), ("none", "holes", "window", "tail")):
        case = Case(d, heads, groups, n, mask, seed=n)
        try:
            for threads, sinks in itertools.product((1, 2, 3, 5), (False, True)):
                ref, out = case.both(threads, sinks)
                assert np.array_equal(ref.view(np.uint32), out.view(np.uint32)), (n, mask, threads, sinks)
        finally:
            case.close()


@kernel_here
@pytest.mark.parametrize(("d", "heads", "groups"), [(128, 32, 4), (256, 4, 1), (64, 8, 8), (512, 16, 2)])
def test_a_prompt_chunk_bit_for_bit_ggml(d: int, heads: int, groups: int) -> None:
    """64 query rows and more (ggml's tiled path) over fewer and more keys than rows, tiles of rows and of keys cut
    short, causal masks with holes, a window and a tail, 1 to 5 threads, with and without sinks: ggml's bits."""
    for (rows, n), mask in itertools.product(((64, 64), (100, 600), (512, 700)), ("none", "holes", "window", "tail")):
        if mask == "tail" and n - 200 <= 0:
            continue
        case = Case(d, heads, groups, n, mask, seed=rows + n, rows=rows)
        try:
            for threads, sinks in ((1, False), (2, True), (3, False), (5, True)):
                ref, out = case.both(threads, sinks)
                assert np.array_equal(ref.view(np.uint32), out.view(np.uint32)), (rows, n, mask, threads, sinks)
        finally:
            case.close()


@kernel_here
def test_more_threads_than_the_node_was_built_for_give_nan_not_memory_past_it() -> None:
    case = Case(128, 8, 2, 600, "none")
    try:
        t = case.t
        node = flash_attention.attention(case.ctx, t["q"], t["k"], t["v"], t["mask"], 0.1, None, 2, [])
        assert np.isnan(case.run(node, 3)).all()
        assert np.isfinite(case.run(node, 2)).all()
    finally:
        case.close()


@kernel_here
def test_takes_a_decode_row_over_512_keys_or_64_rows_of_f16_heads_by_64() -> None:
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=1 << 20, mem_buffer=None, no_alloc=True))
    try:
        f16, f32 = ggml.GGML_TYPE_F16, ggml.GGML_TYPE_F32

        def kv(d: int, n: int, g: int, gtype: int = f16) -> ggml.ggml_tensor_p:
            return ggml.ggml_new_tensor_3d(ctx, gtype, d, n, g)

        mask = ggml.ggml_new_tensor_2d(ctx, f16, 1024, 64)
        takes = flash_attention.takes
        assert takes(1, 512, kv(128, 512, 4), kv(128, 512, 4), 32, mask)
        assert takes(1, 1024, kv(256, 1024, 1), kv(256, 1024, 1), 4, None)
        assert takes(64, 256, kv(128, 256, 4), kv(128, 256, 4), 32, mask)  # a prompt chunk, any number of keys
        assert not takes(1, 256, kv(128, 256, 4), kv(128, 256, 4), 32, mask)  # ggml's path without the split
        assert not takes(2, 1024, kv(128, 1024, 4), kv(128, 1024, 4), 32, mask)  # 2 to 63 rows: ggml's vectors
        assert not takes(63, 1024, kv(128, 1024, 4), kv(128, 1024, 4), 32, mask)
        assert not takes(1, 1024, kv(80, 1024, 4), kv(80, 1024, 4), 32, mask)  # leftover lanes
        assert not takes(64, 1024, kv(128, 1024, 4, f32), kv(128, 1024, 4, f32), 32, mask)
        assert not takes(1, 1024, kv(128, 1024, 1), kv(128, 1024, 1), 64, mask)  # group past 32
        per_head = ggml.ggml_new_tensor_3d(ctx, f16, 1024, 64, 32)
        assert not takes(1, 1024, kv(128, 1024, 4), kv(128, 1024, 4), 32, per_head)
    finally:
        ggml.ggml_free(ctx)


@kernel_here
def test_a_long_prompt_and_its_decode_keep_the_step_graphs_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled Gemma 3 270M (256-wide heads, 4 on one key head) reading a 560-token prompt and decoding past
    512 cached positions: the step graphs take the kernel for both, and every logit equals the one ggml's node
    gives."""
    monkeypatch.delenv(FLASH_ENV, raising=False)
    rng = np.random.default_rng(7)
    prompt = [int(i) for i in rng.integers(100, 20000, 560)]
    taken: list[int] = []  # the query rows of each node the kernel took
    real = flash_attention.attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        taken.append(args[1].contents.ne[1])
        return real(*args, **kwargs)

    logits = []
    for use in (True, False):
        if use:
            monkeypatch.setattr(flash_attention, "attention", counting)
        else:
            monkeypatch.setattr(flash_attention, "takes", lambda *args: False)
        llm = tandem.LLM(default_model_path(), n_ctx=1024, threads=2)
        try:
            first = llm.engine.feed(prompt).numpy()
            logits.append(np.stack([first, *(llm.engine.append([int(t)]).numpy() for t in (5, 17, 300))]))
        finally:
            llm.close()
        if use:
            assert 1 in taken and max(taken) >= 64, f"the kernel took nodes of {sorted(set(taken))} rows"
    assert np.array_equal(logits[0].view(np.uint32), logits[1].view(np.uint32))


@pytest.mark.parametrize("value", ["ggml", "off", "0"])
def test_ggml_by_request(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(flash_attention.ENV, value)
    flash_attention._library.cache_clear()
    try:
        assert flash_attention.available() == (False, f"{flash_attention.ENV}={value}")
    finally:
        flash_attention._library.cache_clear()


def test_an_unknown_setting_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(flash_attention.ENV, "fast")
    flash_attention._library.cache_clear()
    try:
        with pytest.raises(TandemError, match="TANDEM_CPU_FLASH_KERNEL='fast': expected auto"):
            flash_attention.available()
    finally:
        flash_attention._library.cache_clear()
