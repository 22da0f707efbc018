"""Write the fuzzer's seed files: the tests' tiny random models of every architecture, converted to F32 GGUF.

.venv/bin/python scripts/fuzz_seeds.py OUT_DIR
.venv/bin/python -m tandem.fuzz --seeds OUT_DIR --mutants 100000 --findings OUT_DIR/findings
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_models  # noqa: E402 (from tests/, above)

from tandem.convert import convert_hf  # noqa: E402

MAKERS = ("qwen3", "qwen3moe", "gemma3", "qwen35moe", "qwen3next", "gpt_oss", "gemma4")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in MAKERS:
        hf_dir = getattr(tiny_models, f"make_tiny_{name}")(out / f"hf_{name}")
        print(convert_hf(hf_dir, out / f"{name}.gguf", "f32"))


if __name__ == "__main__":
    main()
