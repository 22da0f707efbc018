"""The stages import one way (docs/ARCHITECTURE.md, "Data flow"): GGUF -> plan -> weights -> layers/models ->
runtime -> frontends. A module of a lower stage never imports one of a higher stage, at module level or inside a
function (a lazy import still closes a loop), so the weight loader and the offload machinery stay below the models
and nothing below the runtime reaches up into it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "tandem"
FRONTENDS = {"api", "cli", "server", "bench", "fuzz"}
# each stage: the packages it may not import (everything above it)
ABOVE = {
    "gguf": {"placement", "weights", "layers", "models", "state", "runtime", "cuda", *FRONTENDS},
    "quant": {"placement", "weights", "layers", "models", "state", "runtime", "cuda", *FRONTENDS},
    "state": {"placement", "weights", "layers", "models", "runtime", "cuda", *FRONTENDS},
    "layers": {"weights", "models", "runtime", *FRONTENDS},
    "cuda": {"weights", "models", "runtime", *FRONTENDS},
    "weights": {"models", "runtime", *FRONTENDS},
    "placement": {"weights", "runtime", *FRONTENDS},
    "models": {"runtime", *FRONTENDS},
    "runtime": set(FRONTENDS),
}


def imported_packages(path: Path) -> set[str]:
    """The top-level tandem packages a module imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found |= {n.split(".")[1] for n in names if n.startswith("tandem.")}
    return found


@pytest.mark.parametrize("stage", sorted(ABOVE))
def test_no_import_runs_back_up(stage: str) -> None:
    modules = sorted((SRC / stage).rglob("*.py"))
    assert modules, f"no modules under {stage}/"
    wrong = {str(m.relative_to(SRC)): sorted(imported_packages(m) & ABOVE[stage]) for m in modules}
    assert not {m: w for m, w in wrong.items() if w}, f"{stage}/ imports a higher stage"


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tandem.runtime.engine import Engine\n    import tandem.api\n")
    assert imported_packages(module) == {"runtime", "api"}
