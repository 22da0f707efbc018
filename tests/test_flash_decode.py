"""tandem's CPU decode attention (tandem.quant.flash_decode): bit for bit ggml's flash-attention node on every shape
it takes, thread count, mask and sinks; the shapes it leaves to ggml; the step graphs' logits unchanged with it."""

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
from tandem.quant import flash_decode

kernel_here = pytest.mark.skipif(
    not flash_decode.available()[0], reason=f"not used here: {flash_decode.available()[1]}"
)


class Case:
    """q [D, 1, H], keys and values [D, n, G] (f16), an f16 mask row, sinks [H] in one ggml context with data."""

    def __init__(self, d: int, heads: int, groups: int, n: int, mask: str, seed: int = 0) -> None:
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=(64 << 20) + 8 * d * n * groups, mem_buffer=None,
                                                        no_alloc=False))  # fmt: skip
        rng = np.random.default_rng(seed)
        row = np.zeros((1, n), np.float16)
        if mask == "holes":
            row[0, rng.random(n) < 0.3] = -np.inf
        elif mask == "window":  # a sliding window: the first half masked, whole chunks of keys among them
            row[0, : n // 2] = -np.inf
        elif mask == "tail":  # a cache view past the last position
            row[0, n - 200 :] = -np.inf
        self.t = {name: self._tensor(a) for name, a in {
            "q": (rng.standard_normal((heads, 1, d)) * 3).astype(np.float32),
            "k": (rng.standard_normal((groups, n, d)) * 2).astype(np.float16),
            "v": rng.standard_normal((groups, n, d)).astype(np.float16),
            "mask": row,
            "sinks": rng.standard_normal(heads).astype(np.float32),
        }.items()}  # fmt: skip
        self.heads, self.d = heads, d

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
        return np.ctypeslib.as_array(pointer, shape=(self.heads * self.d,)).copy()

    def both(self, threads: int, sinks: bool, scale: float = 0.0883883) -> tuple[np.ndarray, np.ndarray]:
        t, keep = self.t, []
        ref = ggml.ggml_flash_attn_ext(self.ctx, t["q"], t["k"], t["v"], t["mask"], scale, 0.0, 0.0)
        if sinks:
            ggml.ggml_flash_attn_ext_add_sinks(ref, t["sinks"])
        out = flash_decode.attention(self.ctx, t["q"], t["k"], t["v"], t["mask"], scale, t["sinks"] if sinks else None,
                                     threads, keep)  # fmt: skip
        return self.run(ref, threads), self.run(out, threads)

    def close(self) -> None:
        ggml.ggml_free(self.ctx)


@kernel_here
@pytest.mark.parametrize(("d", "heads", "groups"), [(128, 32, 4), (256, 4, 1), (64, 8, 8), (512, 16, 2)])
def test_bit_for_bit_ggml_flash_attention(d: int, heads: int, groups: int) -> None:
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
def test_more_threads_than_the_node_was_built_for_give_nan_not_memory_past_it() -> None:
    case = Case(128, 8, 2, 600, "none")
    try:
        t = case.t
        node = flash_decode.attention(case.ctx, t["q"], t["k"], t["v"], t["mask"], 0.1, None, 2, [])
        assert np.isnan(case.run(node, 3)).all()
        assert np.isfinite(case.run(node, 2)).all()
    finally:
        case.close()


@kernel_here
def test_takes_one_query_row_over_512_keys_of_f16_heads_by_64() -> None:
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=1 << 20, mem_buffer=None, no_alloc=True))
    try:
        f16, f32 = ggml.GGML_TYPE_F16, ggml.GGML_TYPE_F32

        def kv(d: int, n: int, g: int, gtype: int = f16) -> ggml.ggml_tensor_p:
            return ggml.ggml_new_tensor_3d(ctx, gtype, d, n, g)

        mask = ggml.ggml_new_tensor_2d(ctx, f16, 1024, 1)
        assert flash_decode.takes(1, 512, kv(128, 512, 4), kv(128, 512, 4), 32, mask)
        assert flash_decode.takes(1, 1024, kv(256, 1024, 1), kv(256, 1024, 1), 4, None)
        assert not flash_decode.takes(2, 1024, kv(128, 1024, 4), kv(128, 1024, 4), 32, mask)  # a prompt's rows
        assert not flash_decode.takes(1, 256, kv(128, 256, 4), kv(128, 256, 4), 32, mask)  # ggml's other path
        assert not flash_decode.takes(1, 1024, kv(80, 1024, 4), kv(80, 1024, 4), 32, mask)  # leftover lanes
        assert not flash_decode.takes(1, 1024, kv(128, 1024, 4, f32), kv(128, 1024, 4, f32), 32, mask)
        assert not flash_decode.takes(1, 1024, kv(128, 1024, 1), kv(128, 1024, 1), 64, mask)  # group past 32
        per_head = ggml.ggml_new_tensor_3d(ctx, f16, 1024, 1, 32)
        assert not flash_decode.takes(1, 1024, kv(128, 1024, 4), kv(128, 1024, 4), 32, per_head)
    finally:
        ggml.ggml_free(ctx)


@kernel_here
def test_a_long_decode_keeps_the_step_graphs_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled Gemma 3 270M (256-wide heads, 4 on one key head) decoding past 512 cached positions: the step
    graphs take the kernel, and every logit equals the one ggml's node gives."""
    monkeypatch.delenv(FLASH_ENV, raising=False)
    rng = np.random.default_rng(7)
    prompt = [int(i) for i in rng.integers(100, 20000, 560)]
    taken: list[int] = []
    real = flash_decode.attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        taken.append(1)
        return real(*args, **kwargs)

    logits = []
    for use in (True, False):
        if use:
            monkeypatch.setattr(flash_decode, "attention", counting)
        else:
            monkeypatch.setattr(flash_decode, "takes", lambda *args: False)
        llm = tandem.LLM(default_model_path(), n_ctx=1024, threads=2)
        try:
            llm.engine.feed(prompt)
            logits.append(np.stack([llm.engine.append([int(t)]).numpy() for t in (5, 17, 300)]))
        finally:
            llm.close()
        if use:
            assert taken, "the decode steps past 512 keys did not take the kernel"
    assert np.array_equal(logits[0].view(np.uint32), logits[1].view(np.uint32))


@pytest.mark.parametrize("value", ["ggml", "off", "0"])
def test_ggml_by_request(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(flash_decode.ENV, value)
    flash_decode._library.cache_clear()
    try:
        assert flash_decode.available() == (False, f"{flash_decode.ENV}={value}")
    finally:
        flash_decode._library.cache_clear()


def test_an_unknown_setting_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(flash_decode.ENV, "fast")
    flash_decode._library.cache_clear()
    try:
        with pytest.raises(TandemError, match="TANDEM_CPU_FLASH_KERNEL='fast': expected auto"):
            flash_decode.available()
    finally:
        flash_decode._library.cache_clear()
