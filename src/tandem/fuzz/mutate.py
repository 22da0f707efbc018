"""The cases: GGUF mutants (metadata values, types and counts, tensor shapes, types, offsets and names, header counts,
truncation, garbage weights), hostile chat templates and flag values, drawn from one random generator (a seed gives
the same cases)."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType as T

from tandem.fuzz.gguf_edit import GGUFParts, Tensor, Value

INTS = [0, 1, -1, 2, 3, 7, 255, 2**15, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1]
FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, 3.4e38, float("nan"), float("inf"), float("-inf")]
STRINGS = ["", "x", "\n" * 200, "a\x1b[31m\r\nTraceback (most recent call last):", "é" * 3000, "{{", "none", "yarn",
           "linear", "gpt2", "llama", "qwen2", "\x00"]  # fmt: skip
INT_TYPES = [T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64]
# Keys the readers look up, so that mutations that add keys reach code (with the architecture's prefix).
ARCH_KEYS = [
    "block_count", "embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon", "context_length",
    "vocab_size", "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
    "attention.sliding_window", "attention.sliding_window_pattern", "ssm.conv_kernel", "ssm.state_size",
    "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval", "nextn_predict_layers",
    "final_logit_softcapping", "attention.recurrent_layers",
]  # fmt: skip
TOKENIZER_KEYS = ["bos_token_id", "eos_token_id", "eot_token_id", "unknown_token_id", "padding_token_id",
                  "add_bos_token", "add_eos_token", "pre", "model", "tokens", "scores", "token_type",
                  "merges"]  # fmt: skip

HOSTILE_TEMPLATES = [
    "{{ 'x' * N }}", "{{ [0] * N }}", "{{ 7 ** N }}", "{{ 'a\\nb' | indent(N) }}", "{{ 'a'.center(N) }}",
    "{{ '{:>N}'.format(1) }}", "{{ '%Nd' % 1 }}", "{{ '%Nd' | format(1) }}", "{{ lipsum(N) }}", "{{ range(N) | list }}",
    "{% for i in range(N) %}{% for j in range(N) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * N %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(N) }}", "{{ messages[N] }}", "{{ raise_exception('no') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__ }}", "{% for %}",
    "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "{{ messages | map(attribute='content') | join(' ' * N) }}",
    "{{ messages[0]['content'] | wordwrap(N) }}", "{{ 'x' | truncate(N) }}", "{{ N / 0 }}",
    "{{ strftime_now('%Y' * N) }}",
]  # fmt: skip
FLAG_VALUES = ["0", "-1", "1", "nan", "inf", "-inf", "1e308", "-1e308", str(2**31), str(2**64), str(2**70), "1e-300",
               "10000000000000", "abc", "", "0x10", "2", "100000"]  # fmt: skip
NUMERIC_FLAGS = ["--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n", "-s", "-c", "-t",
                 "-b", "-n", "--n-cpu-moe", "--pcie-experts", "-ngl"]  # fmt: skip


@dataclass
class Case:
    """One run of the CLI: its arguments and the files it reads (written before the run)."""

    kind: str  # gguf, template or flags
    argv: list[str]
    files: dict[Path, bytes]
    what: str  # the mutations, for the report


def _value_like(rng: random.Random, v: Value) -> Value:
    """A hostile value: of the same type mostly, sometimes of another."""
    roll = rng.random()
    if roll < 0.15:  # another type
        return rng.choice([Value(T.STRING, rng.choice(STRINGS)), Value(T.FLOAT32, rng.choice(FLOATS)),
                           Value(rng.choice(INT_TYPES), rng.choice(INTS)), Value(T.BOOL, True),
                           Value(T.ARRAY, [rng.choice(INTS) % 2**32], T.UINT32)])  # fmt: skip
    if v.vtype == T.ARRAY:
        items = list(v.value)
        op = rng.randrange(5)
        if op == 0 or not items:
            items = items[: rng.randrange(len(items) + 1)]
        elif op == 1:
            items = items + items[: rng.randrange(1, 64)]
        elif op == 2 and v.item_type in INT_TYPES:
            items[rng.randrange(len(items))] = rng.choice(INTS)
        elif op == 3 and v.item_type == T.STRING:
            items[rng.randrange(len(items))] = rng.choice(STRINGS)
        else:  # nest it
            return Value(T.ARRAY, [Value(T.ARRAY, items, v.item_type)] * rng.randrange(1, 4), T.ARRAY)
        return Value(T.ARRAY, items, v.item_type)
    if v.vtype == T.STRING:
        return Value(T.STRING, rng.choice([*STRINGS, v.value[: rng.randrange(len(v.value) + 1)], v.value * 2]))
    if v.vtype in (T.FLOAT32, T.FLOAT64):
        return Value(v.vtype, rng.choice([*FLOATS, v.value * 2, -v.value]))
    if v.vtype == T.BOOL:
        return Value(v.vtype, not v.value)
    x = int(v.value)
    return Value(v.vtype, rng.choice([*INTS, x + 1, x - 1, x * 2, x // 2, -x]))


def mutate_gguf(rng: random.Random, seed: GGUFParts, n: int) -> tuple[GGUFParts, str, dict[str, int]]:
    """`n` stacked structure-aware mutations of `seed` (copied): (mutant, what was done, header count lies)."""
    g = copy.deepcopy(seed)
    arch = str(g.metadata["general.architecture"].value) if "general.architecture" in g.metadata else "qwen3"
    done, lies = [], {}
    for _ in range(n):
        op = rng.randrange(16)
        key = rng.choice(list(g.metadata)) if g.metadata else None
        t: Tensor | None = rng.choice(g.tensors) if g.tensors else None
        if op <= 3 and key is not None:
            g.metadata[key] = _value_like(rng, g.metadata[key])
            done.append(f"value {key}")
        elif op == 4:
            key = (
                f"{arch}.{rng.choice(ARCH_KEYS)}"
                if rng.random() < 0.7
                else f"tokenizer.ggml.{rng.choice(TOKENIZER_KEYS)}"
            )
            g.metadata[key] = _value_like(rng, g.metadata.get(key, Value(T.UINT32, 1)))
            done.append(f"set {key}")
        elif op == 5 and key is not None:
            del g.metadata[key]
            done.append(f"drop {key}")
        elif op == 6 and key is not None:
            g.extra_kv.append((key, g.metadata[key]))
            done.append(f"duplicate {key}")
        elif op <= 8 and t is not None:
            axis = rng.randrange(len(t.ne)) if t.ne else 0
            if t.ne:
                t.ne[axis] = rng.choice([0, 1, t.ne[axis] + 1, t.ne[axis] - 1, t.ne[axis] * 2, 2**32, 2**63, 2**64 - 1])
            done.append(f"dims {t.name}")
        elif op == 9 and t is not None:
            t.ne = t.ne[:-1] if t.ne and rng.random() < 0.5 else [*t.ne, rng.choice([1, 2, 2**32])]
            done.append(f"rank {t.name}")
        elif op == 10 and t is not None:
            t.ggml_type = rng.choice([0, 1, 2, 8, 10, 12, 14, 15, 16, 24, 30, 39, 40, 1000])
            done.append(f"type {t.name}")
        elif op == 11 and t is not None:
            t.offset = rng.choice([t.offset + 1, t.offset + g.alignment, 2**40, 2**64 - 1, 0])
            done.append(f"offset {t.name}")
        elif op == 12 and t is not None:
            if rng.random() < 0.5:
                g.tensors.remove(t)
                done.append(f"drop tensor {t.name}")
            else:
                t.name = rng.choice([f"{t.name}\n", t.name * 4, "blk.999.attn_q.weight", g.tensors[0].name, ""])
                done.append(f"rename {t.name[:40]!r}")
        elif op == 13 and t is not None:  # garbage weights: NaN, inf or random bytes over a tensor's data
            start = min(t.offset, len(g.data))
            fill = rng.choice([b"\xff\xff\xff\x7f", b"\x00\x00\x80\x7f", bytes(rng.randrange(256) for _ in range(4))])
            g.data = g.data[:start] + fill * 64 + g.data[start + 256 :]
            done.append(f"garbage {t.name}")
        elif op == 14:
            lies[rng.choice(["n_tensors", "n_kv"])] = rng.choice([0, 1, 2**32, 2**63, 2**64 - 1])
            done.append(f"lie {list(lies)}")
        else:
            g.metadata["general.alignment"] = rng.choice(
                [
                    Value(T.UINT32, rng.choice([0, 1, 3, 48, 64, 2**31])),
                    Value(T.STRING, "32"),
                    Value(T.FLOAT32, float("nan")),
                    Value(T.ARRAY, [32], T.UINT32),
                ]  # fmt: skip
            )
            done.append("alignment")
    return g, "; ".join(done), lies


def gguf_case(rng: random.Random, seed_path: Path, seed: GGUFParts, path: Path) -> Case:
    """A mutant of `seed` written to `path`, given to inspect or run."""
    mutant, what, lies = mutate_gguf(rng, seed, rng.choice([1, 1, 2, 3]))
    data = mutant.encode(**lies)
    if rng.random() < 0.05:  # truncated
        data = data[: rng.randrange(len(data))]
    command = rng.choice(["inspect", "inspect-json", "run", "run", "run-chat"])
    argv = _run_argv(path, rng) if command.startswith("run") else ["inspect", "-m", str(path)]
    if command == "inspect-json":
        argv += ["--json", "--tensors"]
    if command == "run-chat":
        argv.append("--chat")
    return Case("gguf", argv, {path: data}, f"{seed_path.name}: {what} [{command}]")


def _run_argv(path: Path, rng: random.Random) -> list[str]:
    sampling = ["--temp", "0"] if rng.random() < 0.5 else ["-s", str(rng.randrange(2**32))]
    return [
        "run",
        "-m",
        str(path),
        "-p",
        "Hello there",
        "-n",
        "3",
        "--device",
        "cpu",
        "-t",
        "1",
        "-c",
        "128",
        *sampling,
    ]


def template_case(rng: random.Random, seed_path: Path, path: Path) -> Case:
    """A hostile template (written to `path`) given with --chat-template-file to a run of the seed model."""
    parts = [rng.choice(HOSTILE_TEMPLATES).replace("N", str(rng.choice([1, 10, 1000, 10**5, 10**6, 10**9, 10**18])))
             for _ in range(rng.choice([1, 1, 2]))]  # fmt: skip
    template = "".join(parts)
    argv = [*_run_argv(seed_path, rng), "--chat", "--chat-template-file", str(path)]
    return Case("template", argv, {path: template.encode()}, f"{seed_path.name}: {template[:120]!r}")


def flags_case(rng: random.Random, seed_path: Path) -> Case:
    """The seed model run or inspected with hostile numeric flags."""
    argv = _run_argv(seed_path, rng)
    flags = []
    for _ in range(rng.choice([1, 1, 2])):
        flags += [rng.choice(NUMERIC_FLAGS), rng.choice(FLAG_VALUES)]
    command = rng.choice(["run", "run", "inspect"])
    if command == "inspect":
        argv = ["inspect", "-m", str(seed_path)]
        flags = [f for f in flags if f not in ("--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty")]
    return Case("flags", [*argv, *flags], {}, f"{seed_path.name}: {' '.join(flags)} [{command}]")
