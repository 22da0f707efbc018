#!/usr/bin/env python
"""tandem's CPU matrix products against llama.cpp's own, bit for bit, weight type by weight type.

    python scripts/llamacpp_cpu_matmul.py [--lib DIR] [--threads 2] [--json OUT]

tandem holds a CPU model's matrices as llama.cpp's CPU backend holds them (`prepare_cpu_weight` in
tandem/quant/ggml_weights.py: copies repacked for ggml's interleaved kernels) and runs llama.cpp's ggml
(its tiled K-quant kernel from 8 rows among others), so that its products are llama.cpp's to the last bit.
This checks it op by op: the same random weight and activations go through tandem's `CPUKernels.matmul` and
through llama.cpp's ggml (the libraries of llama-cpp-python's CPU build, scripts/build_llamacpp.sh), which a child
process calls through ctypes -- two ggml libraries cannot share a process. The child puts a weight in the
CPU_REPACK buffer where ggml's repack buffer type supports the product (as llama.cpp's loader asks it), else in a
plain CPU buffer, and computes with its backend.

The row counts cover ggml's gemv (1 row) and gemm (4-row groups, the rest by gemv) repacked kernels, and
the tiled kernel's narrow (8-16 rows), standard and multi-window (> 256 rows) paths. Prints one line per case;
exits 1 when a case differs, or when tandem and llama.cpp repack differently.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_LIB = os.path.join(os.path.expanduser("~"), ".cache", "tandem", "peers", "llama_cpp_cpu")
PROBE_ROWS = 512  # the activation rows of llama.cpp's weight_buft_supported probe

# (type, rows N, row length K, activation row counts)
CASES: list[tuple[str, int, int, tuple[int, ...]]] = [
    ("Q6_K", 640, 2048, (1, 7, 8, 9, 16, 17, 64, 300)),
    ("Q6_K", 40, 512, (8, 33)),
    ("Q4_K", 64, 512, (1, 3, 4, 8, 13, 64)),
    ("Q4_K", 60, 512, (1, 8)),
    ("Q4_0", 64, 512, (1, 5, 32)),
    ("IQ4_NL", 64, 512, (1, 5, 32)),
    ("MXFP4", 64, 512, (1, 5, 32)),
    ("Q8_0", 64, 640, (1, 9, 64)),
    ("Q5_0", 64, 640, (1, 9, 64)),
    ("Q5_K", 64, 512, (1, 8)),
    ("Q3_K", 64, 512, (1, 8)),
    ("Q2_K", 64, 512, (1, 8)),
]
# Types llama.cpp's tiled kernel takes (tiled.cpp ggml_tiled_supported) among those above.
TILED_TYPES = {"Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K"}
# Byte offsets of the f16 scale fields inside one block (ggml-common.h).
F16_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def child(lib: str, workdir: Path, threads: int) -> int:
    """Runs in the subprocess: every case of workdir/cases.json through llama.cpp's ggml."""
    import ctypes

    libdir = Path(lib) / "llama_cpp" / "lib"
    base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    import numpy as np  # after the libraries (shared/peers/README.md)

    p, i64, size = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", size), ("mem_buffer", p), ("no_alloc", ctypes.c_bool)]

    def fn(lib_: ctypes.CDLL, name: str, restype: object, *argtypes: object):  # type: ignore[no-untyped-def]
        f = getattr(lib_, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f

    init = fn(base, "ggml_init", p, InitParams)
    free = fn(base, "ggml_free", None, p)
    overhead = fn(base, "ggml_tensor_overhead", size)
    graph_overhead = fn(base, "ggml_graph_overhead", size)
    new_2d = fn(base, "ggml_new_tensor_2d", p, p, ctypes.c_int, i64, i64)
    mul_mat = fn(base, "ggml_mul_mat", p, p, p, p)
    new_graph = fn(base, "ggml_new_graph", p, p)
    expand = fn(base, "ggml_build_forward_expand", None, p, p)
    buft_name = fn(base, "ggml_backend_buft_name", ctypes.c_char_p, p)
    buft_alloc = fn(base, "ggml_backend_buft_alloc_buffer", p, p, size)
    alloc_size = fn(base, "ggml_backend_buft_get_alloc_size", size, p, p)
    buffer_base = fn(base, "ggml_backend_buffer_get_base", p, p)
    buffer_free = fn(base, "ggml_backend_buffer_free", None, p)
    tensor_alloc = fn(base, "ggml_backend_tensor_alloc", ctypes.c_int, p, p, p)
    tensor_set = fn(base, "ggml_backend_tensor_set", None, p, p, size, size)
    tensor_get = fn(base, "ggml_backend_tensor_get", None, p, p, size, size)
    alloc_ctx = fn(base, "ggml_backend_alloc_ctx_tensors", p, p, p)
    compute = fn(base, "ggml_backend_graph_compute", ctypes.c_int, p, p)
    supports_op = fn(base, "ggml_backend_dev_supports_op", ctypes.c_bool, p, p)
    proc_address = fn(base, "ggml_backend_reg_get_proc_address", p, p, ctypes.c_char_p)
    reg_dev = fn(base, "ggml_backend_reg_dev_get", p, p, size)
    log_callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, p)
    quiet = log_callback(lambda level, text, _: None if level == 1 else print(text.decode(), end="", file=sys.stderr))
    fn(base, "ggml_log_set", None, log_callback, p)(quiet, None)  # its repack announces each tensor (debug)
    reg = fn(cpu, "ggml_backend_cpu_reg", p)()
    backend = fn(cpu, "ggml_backend_cpu_init", p)()
    fn(cpu, "ggml_backend_cpu_set_n_threads", None, p, ctypes.c_int)(backend, threads)

    device = reg_dev(reg, 0)
    extra_bufts = ctypes.CFUNCTYPE(ctypes.POINTER(p), p)(proc_address(reg, b"ggml_backend_dev_get_extra_bufts"))
    bufts = extra_bufts(device)
    repack_buft, j = None, 0
    while bufts[j]:  # a NULL-terminated list
        if buft_name(bufts[j]) == b"CPU_REPACK":
            repack_buft = bufts[j]
        j += 1

    cases = json.loads((workdir / "cases.json").read_text())
    results = []
    for case in cases:
        weight = np.fromfile(workdir / case["weight"], dtype=np.uint8)
        x = np.fromfile(workdir / case["x"], dtype=np.float32)
        n, k, t = case["n"], case["k"], case["rows"]
        wctx = init(InitParams(overhead() * 3, None, True))
        w = new_2d(wctx, case["ggml_type"], k, n)
        buffer, repacked = None, False
        if repack_buft:  # llama.cpp's loader: the CPU_REPACK buffer where it supports the weight's product
            probe = mul_mat(wctx, w, new_2d(wctx, 0, k, PROBE_ROWS))
            buffer = buft_alloc(repack_buft, alloc_size(repack_buft, w))
            tensor_alloc(buffer, w, buffer_base(buffer))
            repacked = bool(supports_op(device, probe))
            if not repacked:
                buffer_free(buffer)
                free(wctx)
                wctx = init(InitParams(overhead() * 3, None, True))
                w = new_2d(wctx, case["ggml_type"], k, n)
        if not repacked:
            buffer = alloc_ctx(wctx, backend)
        tensor_set(w, weight.ctypes.data, 0, weight.nbytes)
        ctx = init(InitParams(overhead() * 4 + graph_overhead(), None, True))
        xt = new_2d(ctx, 0, k, t)  # GGML_TYPE_F32
        out = mul_mat(ctx, w, xt)
        graph = new_graph(ctx)
        expand(graph, out)
        io = alloc_ctx(ctx, backend)
        tensor_set(xt, x.ctypes.data, 0, x.nbytes)
        if compute(backend, graph) != 0:
            raise RuntimeError("ggml_backend_graph_compute failed")
        y = np.empty(t * n, dtype=np.float32)
        tensor_get(out, y.ctypes.data, 0, y.nbytes)
        y.tofile(workdir / case["out"])
        results.append({"repacked": repacked})
        for b in (io, buffer):
            buffer_free(b)
        free(ctx)
        free(wctx)
    (workdir / "results.json").write_text(json.dumps(results))
    return 0


def random_weight(qtype_name: str, n: int, k: int, rng):  # type: ignore[no-untyped-def]
    """Random blocks with finite, small scales (random f16 fields; E8M0 exponents for MXFP4)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[Q[qtype_name]]
    nb = n * k // block
    raw = rng.integers(0, 256, (nb, type_size), dtype=np.uint8)
    if qtype_name == "MXFP4":
        raw[:, 0] = rng.integers(120, 131, nb)
    for offset in F16_SCALES.get(qtype_name, ()):
        scales = (rng.uniform(0.5, 1.5, nb) * rng.choice([-1.0, 1.0], nb) * 0.01).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default=DEFAULT_LIB, help="llama-cpp-python's CPU build (a --target directory)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the per-case results here")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.lib, args.child, args.threads)
    if not (Path(args.lib) / "llama_cpp" / "lib" / "libggml-cpu.so").exists():
        print(f"no llama.cpp CPU build under {args.lib} (scripts/build_llamacpp.sh)", file=sys.stderr)
        return 2

    import ggml
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as Q

    from tandem.quant.ggml_cpu import CPUKernels
    from tandem.quant.ggml_weights import GGMLWeight, prepare_cpu_weight

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    # where llama.cpp's x86 build runs its tiled kernel (tiled.cpp: with AVX, unless GGML_CPU_TILED_MM=0)
    tiled_kernel = bool(ggml.ggml_cpu_has_avx()) and os.environ.get("GGML_CPU_TILED_MM", "1") != "0"
    ours: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, CPUKernels(args.threads) as kernels:
        work = Path(tmp)
        cases = []
        for qtype_name, n, k, row_counts in CASES:
            data = random_weight(qtype_name, n, k, rng)
            weight = prepare_cpu_weight(GGMLWeight(data, Q[qtype_name], (n, k)))
            weight_file = f"w{len(ours)}.bin"
            data.tofile(work / weight_file)
            for rows in row_counts:
                i = len(cases)
                x = torch.randn(rows, k)
                x.numpy().tofile(work / f"x{i}.bin")
                cases.append({"ggml_type": int(Q[qtype_name]), "n": n, "k": k, "rows": rows,
                              "weight": weight_file, "x": f"x{i}.bin", "out": f"y{i}.bin"})  # fmt: skip
                tiled = tiled_kernel and qtype_name in TILED_TYPES and weight.repacked is None and rows >= 8
                ours.append({"type": qtype_name, "shape": [n, k], "rows": rows, "repacked": weight.repacked is not None,
                             "tiled": tiled, "y": kernels.matmul(x, weight).numpy().copy()})  # fmt: skip
        (work / "cases.json").write_text(json.dumps(cases))
        cmd = [sys.executable, __file__, "--child", str(work), "--lib", args.lib, "--threads", str(args.threads)]
        subprocess.run(cmd, check=True, timeout=600)
        theirs = json.loads((work / "results.json").read_text())
        failed = 0
        for case, mine, other in zip(cases, ours, theirs, strict=True):
            y_ref = np.fromfile(work / case["out"], dtype=np.float32).reshape(mine["y"].shape)
            y = mine.pop("y")
            mine["differing"] = int((y != y_ref).sum())
            mine["max_abs_diff"] = float(np.abs(y - y_ref).max())
            mine["llamacpp_repacked"] = other["repacked"]
            ok = mine["differing"] == 0
            bad = not ok or mine["repacked"] != other["repacked"]
            failed += bad
            path = "repacked" if mine["repacked"] else "tiled" if mine["tiled"] else "mul_mat"
            verdict = "same bits" if ok else f"{mine['differing']} of {y.size} differ (max {mine['max_abs_diff']:.2g})"
            what = f"{mine['type']:<7} {'x'.join(map(str, mine['shape'])):<9} x{mine['rows']:<4} {path:<9}"
            print(f"{'FAIL' if bad else 'ok  '} {what} {verdict}")
    if args.json:
        args.json.write_text(json.dumps(ours, indent=1))
    print(f"{len(ours) - failed} of {len(ours)} cases as llama.cpp's")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
