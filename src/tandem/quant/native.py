"""Building tandem's own C kernels (`moe_experts.c`, `flash_attention.c`) with the machine's C compiler, on first use.

Each library is built for this CPU (-march=native) into ~/.cache/tandem/native (or $XDG_CACHE_HOME's), named by its
source, its flags, the compiler's version and the CPU, so a new source, compiler or machine gets a new build and a
process never loads one made for another CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tandem.errors import TandemError

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem" / "native"


def cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags") and key not in fields:
            fields[key] = value.strip()
    return f"{platform.machine()} {fields.get('model name', '')} {fields.get('flags', '')}"


def compiler() -> str | None:
    """The C compiler to build with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def setting(env: str) -> str:
    """A kernel's switch, the environment variable env, as "auto" (unset: the kernel where it takes the work) or
    "ggml" ("off", "0": never); TandemError for a value it does not know."""
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    if value in ("ggml", "off", "0"):
        return "ggml"
    if value != "auto":
        raise TandemError(f"{env}={value!r}: expected auto (the default) or ggml (off, 0)")
    return value


def compile_library(source: Path, out: Path, flags: Sequence[str]) -> None:
    """Build source into the shared library out with flags (written beside, then renamed: a process loading it
    meanwhile never sees half a file). Raises OSError with the compiler's last line."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (cc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        cmd = [cc, *flags, "-shared", "-fPIC", "-o", str(part), str(source), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise OSError(f"{cc} failed on {source.name}: {last}")
        os.replace(part, out)


def built(source: Path, flags: Sequence[str]) -> Path:
    """The library of source built with flags for this machine: from the cache, else compiled into it. Raises
    OSError or subprocess.SubprocessError where it cannot be built."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (cc) found")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    identity = source.read_bytes() + " ".join(flags).encode() + version.encode() + cpu_identity().encode()
    path = cache_dir() / f"{source.stem}-{hashlib.sha256(identity).hexdigest()[:16]}.so"
    if not path.exists():
        compile_library(source, path, flags)
    return path


def library(env: str, source: Path, flags: Sequence[str]) -> tuple[ctypes.CDLL | None, str]:
    """A kernel's library for this machine and '', or None and why not: switched off by env (TandemError for a value
    it does not know), another platform, or no build."""
    if setting(env) == "ggml":
        return None, f"{env}={os.environ[env].strip().lower()}"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, "built on x86-64 Linux only"
    try:  # no compiler: built() says so
        return ctypes.CDLL(str(built(source, flags))), ""
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("%s is not used: %s", source.name, e)
        return None, str(e)
