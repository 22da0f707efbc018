"""`tandem run|chat|serve|inspect|convert|bench`: flags and short names follow llama.cpp where one exists."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tandem.errors import TandemError

EXIT_USER_ERROR = 2
MAX_MESSAGE = 1000  # a message echoes paths, names and values: cut, so that it stays one line


def _add_ubatch_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-ub", "--ubatch-size", type=int, default=None,
        help="tokens per computation, as llama.cpp's physical batch (default and at most -b): a step of -b tokens "
        "runs in pieces of it, so -b 2048 -ub 512 computes prompts that arrive together in one step, in the memory "
        "of 512",
    )  # fmt: skip


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M Q4_K_M)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default, or N < 0: physical cores)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="tokens per step, prefill chunks (default 512)")
    _add_parallel_flag(p)
    _add_placement_flags(p)
    p.add_argument(
        "--cache-type", "-ctk", default="f16", choices=["f16", "bf16", "f32"], help="KV cache type (default f16)"
    )
    p.add_argument(
        "--repack-experts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="copy the Q4_K experts computed on the CPU into ggml's repacked layout, as llama.cpp's CPU backend "
        "holds them (host RAM equal to those stacks; default: on where the whole model computes on the CPU, off "
        "beside a GPU, where no decode gain was measured)",
    )
    _add_pcie_flag(p)


def _add_parallel_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="sequences the engine runs at once: the state pool's slots, each of -c tokens (default 1)",
    )


def _add_pcie_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pcie-experts",
        type=int,
        default=0,
        metavar="K",
        help="decode: the GPU computes K of each token's experts kept in host RAM, reading their blocks there "
        "over PCIe (no copy, no VRAM), while the CPU computes the rest (default 0: the CPU computes them all)",
    )


def _add_placement_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="compute device: cpu, cuda, cuda:K (default: cuda if visible)")
    p.add_argument("--cpu-moe", action="store_true", help="keep every routed-expert tensor on the CPU")
    p.add_argument("--n-cpu-moe", type=int, default=0, metavar="N", help="keep the experts of layers 0..N-1 on the CPU")
    p.add_argument(
        "-ot",
        "--override-tensor",
        action="append",
        default=[],
        metavar="REGEX=DEVICE",
        help="place tensors whose name matches REGEX on DEVICE (cpu, cuda, cuda:K); repeatable, first match wins",
    )
    p.add_argument(
        "--gpu-memory",
        default=None,
        metavar="BUDGET",
        help="VRAM budget (e.g. 24GiB) as the driver counts it (the CUDA context's 1.25 GiB included): the non-expert "
        "weights, KV cache and workspace, then as many experts as fit (whole layers or single experts, by "
        "--expert-stats)",
    )
    p.add_argument(
        "--moe-cache",
        default=None,
        metavar="SIZE",
        help="VRAM (e.g. 8GiB) for single experts of the layers kept in host RAM (--cpu-moe, --n-cpu-moe, -ot): the "
        "most picked by --expert-stats, else the lowest ids; each step computes those on the GPU, the rest on the CPU",
    )
    p.add_argument(
        "--moe-cache-refresh",
        type=int,
        default=0,
        metavar="STEPS",
        help="every STEPS steps, swap cached experts for hotter ones by the picks counted meanwhile (copies in the "
        "background into a spare slot; default 0: the experts chosen at the start stay)",
    )
    p.add_argument(
        "--expert-stats",
        default=None,
        metavar="FILE",
        help="routing statistics: read at the start to choose the experts kept in VRAM (--moe-cache, --gpu-memory), "
        "counted on the GPU while running, written back at the end (a file of another model is an error)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: GPUs, or CPU ranks with --device cpu")
    p.add_argument(
        "-ngl",
        "--n-gpu-layers",
        "--gpu-layers",
        type=int,
        default=None,
        metavar="N",
        help="llama.cpp's flag: the layer count or more (e.g. 99) keeps the layers on the GPU, 0 on the CPU; "
        "tandem does not split them (offload experts instead)",
    )
    p.add_argument(
        "--dtype", default=None, choices=["bf16", "f16", "f32"], help="GPU compute type (default bf16; CPU: f32)"
    )


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k, 0 or less = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p, 1.0 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p, 0 = off (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty, 1.0 = off (default)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back on (default 64)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="lowers seen tokens' logits, 0 = off (default)")
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="lowers seen tokens' logits per occurrence, 0 = off"
    )
    p.add_argument("-s", "--seed", type=int, default=None, help="random seed (default, or -1 as llama.cpp: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def int_list(text: str) -> list[int]:
    """'512,2048' -> [512, 2048] (the --pp syntax)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got '{text}'") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _add_compare_flags(p: argparse.ArgumentParser) -> None:
    # `tandem bench --compare llamacpp --report DIR`: each run in a worker process (src/tandem/bench/compare.py).
    p.add_argument("--compare", choices=["llamacpp"], default=None, help="also run llama.cpp, same placement")
    p.add_argument("--report", metavar="DIR", default=None, help="write DIR/report.{json,md,png}")
    p.add_argument(
        "--matrix",
        default=None,
        metavar="LIST",
        help="placements to run, e.g. all,cpu-moe,n-cpu-moe=half (default: the placement flags given)",
    )
    p.add_argument(
        "--timeout", type=float, default=1800.0, metavar="S",
        help="per repetition; the first also covers load and warm-up (default 1800)",
    )  # fmt: skip
    p.add_argument("--budget", type=float, default=None, metavar="S", help="start no run after S seconds in all")
    p.add_argument(
        "--process-reps", type=int, default=None, metavar="K",
        help="repetitions per worker process, the engines taking turns (default: the reps in two processes each)",
    )  # fmt: skip
    p.add_argument(
        "--peer-lib",
        default=None,
        metavar="DIR",
        help="llama-cpp-python install (default $TANDEM_LLAMACPP_LIB or ~/.cache/tandem/peers/llama_cpp_{cuda,cpu})",
    )


def _add_template_flag(p: argparse.ArgumentParser) -> None:
    from tandem.tokenizer.builtin_templates import BUILTIN_TEMPLATES  # here: Ctrl-C during its imports is caught

    p.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME",
        help=f"a built-in chat template instead of the model's ({', '.join(BUILTIN_TEMPLATES)})",
    )
    p.add_argument(
        "--chat-template-file",
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's (for a GGUF without one, or to override it)",
    )
    p.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="extra chat template variables, a JSON object, e.g. '{\"enable_thinking\": false}'",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate from one prompt, streamed to stdout")
    _add_model_flags(run)
    _add_ubatch_flag(run)
    _add_sampling_flags(run)
    run.add_argument("-p", "--prompt", required=True, help="the prompt")
    run.add_argument(
        "-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128; -1: no limit)"
    )
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("-sys", "--system-prompt", default=None, help="system message (with --chat)")
    _add_template_flag(run)

    chat = sub.add_parser("chat", help="interactive multi-turn chat (keeps the KV cache between turns)")
    _add_model_flags(chat)
    _add_ubatch_flag(chat)
    _add_sampling_flags(chat)
    chat.add_argument(
        "-n", "--n-predict", type=int, default=512, help="max tokens per reply (default 512; -1: no limit)"
    )
    chat.add_argument("-sys", "--system-prompt", default=None, help="system message")
    _add_template_flag(chat)

    serve = sub.add_parser("serve", help="an OpenAI- and Ollama-compatible HTTP server on the engine")
    _add_model_flags(serve)
    _add_ubatch_flag(serve)
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="the TCP port (default 8080)")
    serve.add_argument(
        "--api-key", default=None, metavar="KEY", help="require 'Authorization: Bearer KEY' on all but /health"
    )
    _add_template_flag(serve)

    inspect = sub.add_parser("inspect", help="metadata, sizes, quant mix and the tensor table")
    inspect.add_argument("-m", "--model", help="GGUF file (default: the bundled model)")
    inspect.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size for the plan (default 4096)")
    inspect.add_argument("-b", "--batch-size", type=int, default=512, help="prefill batch for the plan (default 512)")
    _add_parallel_flag(inspect)
    inspect.add_argument("--cache-type", "-ctk", default="f16", choices=["f16", "bf16", "f32"])
    _add_placement_flags(inspect)
    _add_pcie_flag(inspect)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.add_argument("--tensors", action="store_true", help="list every tensor")

    convert = sub.add_parser("convert", help="convert a Hugging Face checkpoint directory to GGUF")
    convert.add_argument("hf_dir", help="directory with config.json, *.safetensors and the tokenizer")
    convert.add_argument("-o", "--outfile", required=True, help="output .gguf path")
    convert.add_argument("--outtype", default="f16", choices=["f32", "f16", "q8_0"])
    convert.add_argument("--overwrite", action="store_true", help="replace an existing output file")

    from tandem.synth.presets import PRESETS  # names only: cheap

    synth = sub.add_parser("synth", help="write a random model with a real model's shapes (speed tests)")
    synth.add_argument("--like", required=True, metavar="NAME", help=f"preset: {', '.join(PRESETS)}")
    synth.add_argument("-o", "--outfile", required=True, help="output .gguf path")
    synth.add_argument("--layers", type=int, default=None, help="keep only the first N layers (default: all)")
    synth.add_argument("--quant", default="Q4_K_M", help="type mix: Q4_K_M (default), Q8_0 or F16")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument(
        "--routing",
        default="uniform",
        metavar="SPEC",
        help="expert popularity: uniform (the random routers, default), zipf:S (per layer, an expert of rank r "
        "takes a share of the routing proportional to r**-S; the routers are fitted on a CPU run of the model) or "
        "zipf:S,drift:P (P token id ranges, each with a ranking of its own: texts that move between them drift)",
    )
    synth.add_argument("--overwrite", action="store_true", help="replace an existing output file")

    bench = sub.add_parser("bench", help="prefill and decode tokens/s, peak memory; --compare llamacpp")
    _add_model_flags(bench)
    bench.add_argument(
        "--pp", type=int_list, default=[128], help="prompt tokens to prefill, comma-separated sizes (default 128)"
    )
    bench.add_argument("--tg", type=int, default=64, help="tokens to generate (default 64)")
    bench.add_argument("--reps", type=int, default=3, help="repetitions; the median is reported (default 3)")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the first repetition's prompt seed, the next ones' counting up (default 0; e.g. a recording of "
        "--expert-stats on other texts than the timed runs')",
    )
    bench.add_argument(
        "--concurrency",
        type=int_list,
        default=None,
        metavar="N,...",
        help="the engine with N sequences at once (one --pp size): prefill and decode tok/s, aggregate and per stream",
    )
    bench.add_argument(
        "--drift",
        type=int,
        default=None,
        metavar="N",
        help="decode a scripted text whose hot experts move on every N tokens (a model of tandem synth --routing "
        "zipf:S,drift:P; one --pp size, --tg tokens fed one per step): decode tok/s per --drift-window",
    )
    bench.add_argument(
        "--drift-window", type=int, default=64, metavar="W", help="tokens per reported window of --drift (default 64)"
    )
    _add_compare_flags(bench)
    return parser


def _commands() -> dict[str, Callable[[argparse.Namespace], int]]:
    # Imported lazily so that `tandem --help` and argument errors stay fast.
    from tandem.cli import commands

    return {
        "run": commands.run,
        "chat": commands.chat,
        "serve": commands.serve,
        "inspect": commands.inspect,
        "convert": commands.convert,
        "synth": commands.synth,
        "bench": commands.bench,
    }


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return _commands()[args.command](args)
    except TandemError as e:
        from tandem.gguf.header import one_line  # here: `tandem --help` stays fast

        print(f"error: {one_line(str(e), limit=MAX_MESSAGE)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
