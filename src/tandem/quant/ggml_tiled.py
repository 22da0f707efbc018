"""llama.cpp's tiled K-quant matrix product for Q6_K weights, computed exactly in torch.

llama.cpp's CPU backend (ggml-cpu/tiled, newer than tandem's ggml-python 0.0.45) multiplies a K-quant
weight that is not repacked by 8 activation rows or more (`ggml_tiled_min_batch`) with a 256x256 tiled
kernel instead of `vec_dot`. The kernel adds in another order, so its results differ from ggml's
`mul_mat` by a few units in the last place: enough to change greedy tokens. tandem's ggml has no such
kernel; `TiledQ6K` reproduces its Q6_K case bit for bit.

What the kernel computes for a Q6_K weight (tiled-kernel.cpp; its AVX-512 VNNI and AVX2 variants do the
same arithmetic for Q6_K):

* the activations are quantized to Q8_K (`quantize_row_q8_K_ref`): per 256 values, int8 codes c and a
  float32 scale d_x;
* per weight row, activation row and 256-value block, an exact integer sum over the 16 sub-blocks:
  s = sum_sub scale_sub * sum_e (q_e - 32) * c_e, with |s| < 2^27;
* r = float(s) * d_w (float32), then acc = fma(r, d_x, acc), block after block from acc = 0 (a
  multiply then an add where the build has no FMA).

Here the integer sums are int8 matrix products with int32 sums (`torch._int_mm`, oneDNN's VNNI kernels): each
weight code times its sub-block scale, w = (q - 32) * scale in [-4064, 4096], is split as 64 * hi + lo with both
parts int8 (hi in [-64, 64], lo in [-32, 31]), so s = 64 * (hi . c) + (lo . c) exactly; without `_int_mm` they are
float64 matrix products (exact: every partial sum is an integer below 2^53). The float steps are float32 ones;
the fused multiply-add is rounded once (`fma32`). The result is
llama.cpp's to the bit (scripts/llamacpp_cpu_matmul.py checks it against llama.cpp's own ggml for 8 to
300 rows); it takes 2.5-3.5x the time of ggml's product (640 x 2048, 8 to 512 rows, 2 threads).

Where: llama.cpp compiles the tiled path into x86 builds with AVX, AVX2 or AVX-512 VNNI and enables it
unless GGML_CPU_TILED_MM is 0; `TILED_ARITHMETIC` follows ggml's own build flags and that variable (a
native build's flags are the machine's, as llama.cpp's native build). Only Q6_K is ported; the
kernel's other types (Q5_K, Q4_K not repacked, Q3_K, Q2_K, IQ*) still go through ggml's `mul_mat`.

Memory: a weight's two int8 parts are made and kept on first use: 2 bytes per weight, against 0.82 for the GGUF
blocks (Gemma 3 270M: 9 tensors of 640 x 2048, 23 MiB); for the float64 products, its codes (q - 32, int8) and
sub-block scales (int8), 1.06 bytes per weight.
A tensor whose codes would exceed `CACHE_MAX_BYTES` is unpacked again, in row chunks, on every call
instead. Each call's float64 temporaries are bounded by `CHUNK_BYTES` (blocks and rows in chunks),
besides the activation codes (8 bytes per activation value).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import warnings

import ggml
import numpy as np
import torch
from gguf import GGMLQuantizationType

__all__ = ["TILED_ARITHMETIC", "TILED_MIN_ROWS", "TiledQ6K", "fma32", "quantize_q8_k", "tiled_product"]

TILED_MIN_ROWS = 8  # ggml_tiled_min_batch: the tiled kernel runs from this many activation rows
CACHE_MAX_BYTES = 64 << 20  # a weight's unpacked codes are kept up to this size
CHUNK_BYTES = 64 << 20  # float64 temporaries of one step of a call
GROUP_BYTES = 2 << 20  # int32 block sums of one step of the int8 products

_QK_K = 256
Q8_K_BYTES = 292  # block_q8_K: d (float32), 256 codes (int8), 16 partial sums (int16)
_Q6_K_BYTES = 210  # ql[128] | qh[64] | scales[16] (int8) | d (f16)
# The 29 fraction bits a float64 has beyond a float32, and their pattern halfway between two float32 values.
_F32_DROPPED_BITS = (1 << 29) - 1
_F32_HALFWAY = 1 << 28
_F32_MIN_NORMAL = 2.0**-126


def _env_enabled(name: str) -> bool:
    """C's `env == NULL || atoi(env) != 0`, as ggml reads GGML_CPU_TILED_MM."""
    value = os.environ.get(name)
    if value is None:
        return True
    digits = re.match(r"\s*([+-]?\d+)", value)
    return digits is not None and int(digits.group(1)) != 0


def _tiled_arithmetic() -> str | None:
    """How this machine's llama.cpp build runs the tiled kernel's float steps: "fma", "mul_add", or None
    where it has no tiled kernel (not an x86 build with AVX, or GGML_CPU_TILED_MM=0)."""
    if not _env_enabled("GGML_CPU_TILED_MM") or not ggml.ggml_cpu_has_avx():
        return None
    return "fma" if ggml.ggml_cpu_has_fma() else "mul_add"


TILED_ARITHMETIC = _tiled_arithmetic()
INT8_PRODUCTS = hasattr(torch, "_int_mm")  # int8 x int8 -> int32 products on the CPU (oneDNN)
# oneDNN's int8 products are fast only with VNNI instructions; without them (AVX2 CPUs such as AMD Zen 3) `_int_mm`
# falls back to a scalar loop ~10x slower than the float32 products, which are as exact here: a block's sums of
# int8 codes times int8 parts stay below 2^24 (64 * 127 * 256), so every partial sum is an integer a float32 holds.
INT8_VNNI = torch.backends.cpu.get_cpu_capability() != "DEFAULT" and torch.cpu._is_vnni_supported()


def tiled_product(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> TiledQ6K | None:
    """The tiled kernel's product for a matrix that llama.cpp's CPU backend would multiply with it, or
    None (another type, or no tiled kernel on this machine)."""
    if TILED_ARITHMETIC is None or qtype != GGMLQuantizationType.Q6_K or len(shape) != 2:
        return None
    return TiledQ6K(data, (shape[0], shape[1]), TILED_ARITHMETIC)


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `quantize_row_q8_K_ref` on float32 x [T, K]: codes [T, K/256, 256] (integers as float32)
    and scales d [T, K/256] (float32).

    Per 256-block: the value of largest magnitude (the first one), iscale = -127 / that value, codes
    nearest_int(iscale * x) capped at 127 (round half to even, as ggml's magic-number rounding), and
    d = 1 / iscale; an all-zero block gets codes 0 and d 0."""
    t, k = x.shape
    blocks = x.reshape(t, k // _QK_K, _QK_K)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # argmax: the first of equal maxima
    zero = peak == 0
    # torch.div of two tensors: `number / tensor` is a reciprocal then a multiply, rounded twice.
    iscale = torch.where(zero, 0.0, torch.div(torch.tensor(-127.0), peak))
    codes = torch.round(iscale * blocks).clamp_(max=127)
    d = torch.where(zero, 0.0, torch.div(torch.tensor(1.0), iscale))
    return codes, d[..., 0]


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c with a single rounding (a fused multiply-add), for float32 tensors: a of the result's
    shape, b and c of it or broadcasting against it.

    a * b is exact in float64, and so the float64 sum s is the exact sum rounded once. Rounding s again
    to float32 gives the exact sum's float32 rounding unless s is itself halfway between two float32
    values (a boundary of that rounding cannot lie strictly between the exact sum and its nearest
    float64), or in float32's subnormal range, where those halfway points lie elsewhere: those few (found
    in place, with zeros among them) are made round-to-odd first (their exact error, from TwoSum, says which
    neighbour), which rounds right."""
    s = a.double().mul_(b.double()).add_(c.double())
    r = s.float()
    hard = (s.view(torch.int64) & _F32_DROPPED_BITS) == _F32_HALFWAY
    hard |= r.abs() <= _F32_MIN_NORMAL
    if bool(hard.any()):
        p = a.expand_as(s)[hard].double() * b.expand_as(s)[hard].double()
        c64 = c.expand_as(s)[hard].double()
        sh = p + c64
        z = sh - p
        err = (p - (sh - z)) + (c64 - z)  # sh + err == p + c exactly
        inexact_even = (err != 0) & ((sh.view(torch.int64) & 1) == 0)
        odd = torch.nextafter(sh, torch.copysign(torch.full_like(sh, torch.inf), err))
        r[hard] = torch.where(inexact_even, odd, sh).float()
    return r


def _unpack_q6_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks [n, B, 210] -> codes q - 32 [B, n, 256] int8, sub-block scales [B, n, 16] int8 and
    d [B, n] float32 (ggml's `dequantize_row_q6_K` layout: 128-value halves, low nibbles then high
    nibbles of ql, 2-bit fields of qh in four runs of 32)."""
    n, nb, _ = raw.shape
    ql = raw[..., :128].reshape(n, nb, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, nb, _QK_K)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    high = ((raw[..., 128:192].reshape(n, nb, 2, 1, 32) >> shifts) & 3).reshape(n, nb, _QK_K)
    codes = (low | (high << 4)).view(torch.int8) - 32
    scales = raw[..., 192:208].contiguous().view(torch.int8)
    d = raw[..., 208:210].contiguous().view(torch.float16)[..., 0].float()
    return codes.transpose(0, 1).contiguous(), scales.transpose(0, 1).contiguous(), d.t().contiguous()


class TiledQ6K:
    """x @ W^T for one Q6_K weight W (N, K), as llama.cpp's tiled kernel computes it.

    `data` is W's raw GGUF bytes (kept referenced, not copied); the unpacked codes are built on the first
    call and kept when they fit `CACHE_MAX_BYTES`. Calls may come from several threads.
    """

    def __init__(self, data: np.ndarray, shape: tuple[int, int], arithmetic: str = "fma") -> None:
        n, k = shape
        if k % _QK_K or data.nbytes != n * (k // _QK_K) * _Q6_K_BYTES:
            raise ValueError(f"not the bytes of a Q6_K weight of shape {shape}")
        if arithmetic not in ("fma", "mul_add"):
            raise ValueError(f"arithmetic must be 'fma' or 'mul_add', got {arithmetic!r}")
        self.data = data
        self.shape = (n, k)
        self.arithmetic = arithmetic
        self._parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lock = threading.Lock()

    @property
    def cache_bytes(self) -> int:
        """Bytes of the unpacked codes, scales and block scales (kept or rebuilt per call)."""
        n, k = self.shape
        return n * k + n * (k // 16) + n * (k // _QK_K) * 4

    def _blocks(self, r0: int, r1: int) -> torch.Tensor:
        n, k = self.shape
        with warnings.catch_warnings():  # a read-only memory map: only ever read here
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.data)
        return raw.view(n, k // _QK_K, _Q6_K_BYTES)[r0:r1]

    def _rows(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, scales and d of weight rows r0:r1 (from the cache when it is kept)."""
        if self.cache_bytes > CACHE_MAX_BYTES:
            return _unpack_q6_k(self._blocks(r0, r1))
        with self._lock:
            if self._parts is None:
                self._parts = _unpack_q6_k(self._blocks(0, self.shape[0]))
        codes, scales, d = self._parts
        return codes[:, r0:r1], scales[:, r0:r1], d[:, r0:r1]

    def _int8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block, the weights' codes times their sub-block scales as 64 * hi + lo, [B, 256, 2N] int8 (hi in
        columns :N, lo in N:), and d [B, N] float32; made once."""
        with self._lock:
            if self._int8 is None:
                n, k = self.shape
                codes, scales, d = _unpack_q6_k(self._blocks(0, n))  # [B, N, 256], [B, N, 16], [B, N]
                w = codes.to(torch.int16) * scales.to(torch.int16).repeat_interleave(16, dim=-1)
                lo = torch.remainder(w + 32, 64) - 32
                hi = torch.div(w - lo, 64, rounding_mode="floor")
                parts = torch.cat([hi, lo], dim=1).to(torch.int8).transpose(1, 2).contiguous()  # [B, 256, 2N]
                self._int8 = (parts, d)
        return self._int8

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] float32 (contiguous, CPU) -> [T, N] float32: a fresh tensor, or `out` filled."""
        n, k = self.shape
        t = x.shape[0]
        y = torch.empty(t, n, dtype=torch.float32) if out is None else out
        if INT8_PRODUCTS and 2 * n * k <= CACHE_MAX_BYTES:
            return self._matmul_int8(x, y)
        codes, d_x = quantize_q8_k(x)
        codes = codes.transpose(0, 1).double()  # [B, T, 256]
        nb = k // _QK_K
        # Rows per step so that one block's temporaries (weights and sums, float64) fit; then blocks per step.
        rows = n if self.cache_bytes <= CACHE_MAX_BYTES else max(16, CACHE_MAX_BYTES // (k + k // 16))
        rows = max(1, min(rows, CHUNK_BYTES // (8 * (_QK_K + t))))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            q, scales, d_w = self._rows(r0, r1)
            m = r1 - r0
            step = max(1, min(nb, CHUNK_BYTES // (8 * m * (_QK_K + t))))
            acc = torch.zeros(t, m, dtype=torch.float32)
            for b0 in range(0, nb, step):
                b1 = min(nb, b0 + step)
                w = torch.empty(b1 - b0, m, 16, 16, dtype=torch.float64)
                w.copy_(q[b0:b1].view(b1 - b0, m, 16, 16)).mul_(scales[b0:b1].unsqueeze(-1))
                sums = torch.bmm(codes[b0:b1], w.view(b1 - b0, m, _QK_K).transpose(1, 2))  # [b, T, m], exact
                r = sums.float() * d_w[b0:b1].unsqueeze(1)
                for i in range(b1 - b0):
                    dx = d_x[:, b0 + i : b0 + i + 1]
                    acc = fma32(r[i], dx, acc) if self.arithmetic == "fma" else acc + r[i] * dx
            y[:, r0:r1] = acc
        return y

    @property
    def int8(self) -> bool:
        """Whether the block sums are int8 products here (see the module docstring)."""
        n, k = self.shape
        return INT8_PRODUCTS and 2 * n * k <= CACHE_MAX_BYTES

    def matmul_q8_k(self, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The product from activations quantized to Q8_K already, as ggml quantizes them (a graph's copy to a Q8_K
        tensor: `quantize_row_q8_K_ref`, what `quantize_q8_k` computes): blocks [T, K / 256 * 292] uint8 (per block
        d float32, the 256 codes int8, 16 sums int16), out [T, N] float32. Only where `int8`."""
        t, k = blocks.shape[0], self.shape[1]
        raw = blocks.view(t, k // _QK_K, Q8_K_BYTES)
        d_x = raw[..., :4].view(torch.float32)[..., 0]  # [T, B], strided views of the blocks: no copies
        codes = raw[..., 4 : 4 + _QK_K].view(torch.int8)  # [T, B, 256]
        return self._int8_products(codes, d_x, out)

    def _matmul_int8(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        codes, d_x = quantize_q8_k(x)
        return self._int8_products(codes.to(torch.int8), d_x, y)

    def _int8_products(self, codes: torch.Tensor, d_x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = the kernel's result from the activations' codes [T, B, 256] int8 and scales d_x [T, B] (each block's
        rows may be strided)."""
        n = self.shape[0]
        parts, d_w = self._int8_parts()
        t, nb = codes.shape[0], codes.shape[1]
        fused = self.arithmetic == "fma" and fused_addcmul()  # torch's float32 addcmul is a fused multiply-add
        # blocks a step: their sums within GROUP_BYTES (in the cache), in as few calls as fit
        group = max(1, min(nb, GROUP_BYTES // (8 * t * n)))
        sums = torch.empty(group, t, 2 * n, dtype=torch.int32)
        if not INT8_VNNI:
            codes = codes.float()
            sums_f32 = torch.empty(t, 2 * n, dtype=torch.float32)
        s = torch.empty(group, t, n, dtype=torch.int32)
        r = torch.empty(group, t, n, dtype=torch.float32) if fused else torch.empty(nb, t, n, dtype=torch.float32)
        if fused:
            y.zero_()
        for b0 in range(0, nb, group):
            g = min(group, nb - b0)
            for i in range(g):
                if INT8_VNNI:
                    torch._int_mm(codes[:, b0 + i], parts[b0 + i], out=sums[i])  # [T, 2N] int32, exact
                else:
                    sums[i].copy_(torch.matmul(codes[:, b0 + i], parts[b0 + i].float(), out=sums_f32))  # exact
            torch.add(sums[:g, :, n:], sums[:g, :, :n], alpha=64, out=s[:g])  # |s| < 2^27: exact in int32
            rb = r[:g] if fused else r[b0 : b0 + g]
            torch.mul(s[:g], d_w[b0 : b0 + g].unsqueeze(1), out=rb)  # float(s) * d_w, as the kernel rounds it
            if fused:
                for i in range(g):
                    torch.addcmul(y, rb[i], d_x[:, b0 + i].unsqueeze(1), out=y)
        if not fused:
            _accumulate(r.numpy(), d_x.t().contiguous().numpy(), y.numpy(), self.arithmetic)
        return y


_CHAIN_ROWS = 32  # rows of a step of `_accumulate`: its float64 temporaries stay in the cache


@functools.cache
def fused_addcmul() -> bool:
    """Whether torch's float32 `addcmul(c, a, b)` rounds a * b + c once on this build and CPU, broadcast row factors
    and vector tails included (its kernel is `c + a * b`, which the compiler contracts into an FMA where it may):
    checked against `fma32` on cases where one rounding and two differ."""
    g = torch.Generator().manual_seed(0)
    for rows, cols in ((1, 1), (3, 5), (2, 16), (5, 33), (7, 640), (4, 1027)):
        a = torch.randn(rows, cols, generator=g)
        b = torch.randn(rows, 1, generator=g)
        c = torch.randn(rows, cols, generator=g) * torch.logspace(-8, 2, cols).unsqueeze(0)
        if not torch.equal(torch.addcmul(c, a, b), fma32(a, b, c)):
            return False
        out = c.clone()
        if not torch.equal(torch.addcmul(out, a, b, out=out), fma32(a, b, c)):
            return False
    return True


def _accumulate(r: np.ndarray, d_x: np.ndarray, out: np.ndarray, arithmetic: str) -> None:
    """out[t, j] = the kernel's acc after the blocks: acc = fma(r[b, t, j], d_x[b, t], acc) from acc = 0, block
    after block (arithmetic "fma"; a float32 multiply and add for "mul_add"). r [B, T, N], d_x [B, T] float32.

    The fused multiply-add as `fma32` computes it, in numpy on row chunks: r * d_x is exact in float64, the sum
    with acc is rounded once to float64, then to float32; where that float64 sum lies halfway between two float32
    values, or in float32's subnormal range, it is first made round-to-odd from its exact error (TwoSum)."""
    nb, t, _ = r.shape
    for r0 in range(0, t, _CHAIN_ROWS):
        rows = slice(r0, min(t, r0 + _CHAIN_ROWS))
        if arithmetic != "fma":
            acc = np.zeros_like(out[rows])
            for b in range(nb):
                acc += r[b, rows] * d_x[b, rows, None]
            out[rows] = acc
            continue
        acc = (r[0, rows] * d_x[0, rows, None].astype(np.float64)).astype(np.float32)  # fma(r, d_x, 0): one rounding
        for b in range(1, nb):
            p = r[b, rows] * d_x[b, rows, None].astype(np.float64)  # exact
            s = p + acc
            new = s.astype(np.float32)
            hard = (s.view(np.int64) & _F32_DROPPED_BITS) == _F32_HALFWAY
            hard |= np.abs(new) < _F32_MIN_NORMAL
            if hard.any():
                ph, ch, sh = p[hard], acc[hard].astype(np.float64), s[hard]
                z = sh - ph
                err = (ph - (sh - z)) + (ch - z)  # sh + err == ph + ch exactly
                odd = np.nextafter(sh, np.copysign(np.inf, err))
                new[hard] = np.where((err != 0) & ((sh.view(np.int64) & 1) == 0), odd, sh).astype(np.float32)
            acc = new
        out[rows] = acc
