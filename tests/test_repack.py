"""When tandem copies CPU expert stacks into ggml's repacked layout (runtime/repack.py): the modes, the RAM
check of `auto`, and the copies made by a pool of threads while loading. That the copies give the experts'
products is tests/test_synth.py's (CPU) and tests/test_gpu_offload.py's (the captured step)."""

from __future__ import annotations

from pathlib import Path

import ggml
import pytest

from tandem.errors import TandemError
from tandem.gguf import open_gguf
from tandem.runtime import repack
from tandem.runtime.repack import ExpertRepacks, fits_in_ram, meminfo, repack_mode
from tandem.synth.writer import synthesize

GiB = 1 << 30


def test_modes() -> None:
    assert [repack_mode(v) for v in (None, True, False, "auto", "on", "off")] == ["auto", "on", "off"] * 2
    with pytest.raises(TandemError, match="repack_experts must be one of auto, on, off, got 'yes'"):
        repack_mode("yes")


def test_meminfo_and_the_ram_check(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text(
        "MemTotal:       131072000 kB\nMemAvailable:    65536000 kB\nHugePages_Total: 0\n"
    )
    memory = meminfo(tmp_path / "meminfo")
    assert memory == {"MemTotal": 131072000 * 1024, "MemAvailable": 65536000 * 1024, "HugePages_Total": 0}
    assert meminfo(tmp_path / "absent") == {}
    total = 128 * GiB
    # 13 GiB copied beside 18 GiB of file pages: 100 GiB available leaves 69 >= 12.8; 40 leaves 9 < 12.8.
    assert fits_in_ram(13 * GiB, 18 * GiB, {"MemTotal": total, "MemAvailable": 100 * GiB})[0]
    fits, why = fits_in_ram(13 * GiB, 18 * GiB, {"MemTotal": total, "MemAvailable": 40 * GiB})
    assert not fits and why == "31.0 GiB with the experts' file pages, 40.0 GiB available of 128.0"
    assert fits_in_ram(1, 1, {}) == (False, "the host's free memory is unknown")


@pytest.fixture(scope="module")
def expert_stacks(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The expert stacks of a 1-layer synthetic Qwen3-30B-A3B (gate and up Q4_K, down Q6_K or Q4_K)."""
    path = synthesize("qwen3-30b-a3b", tmp_path_factory.mktemp("repack") / "q.gguf", layers=1, fill="random").path
    f = open_gguf(path)
    yield [info for name, info in f.tensors.items() if "_exps." in name]


def test_auto_repacks_beside_a_gpu_when_the_ram_has_room(expert_stacks, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if not ggml.ggml_cpu_has_avx2():
        pytest.skip("ggml repacks Q4_K only with AVX2")
    q4k = [i for i in expert_stacks if i.qtype.name == "Q4_K"]
    monkeypatch.setattr(repack, "meminfo", lambda: {"MemTotal": 128 * GiB, "MemAvailable": 100 * GiB})
    repacks = ExpertRepacks(expert_stacks, "auto", on_gpu=True, threads=2)
    assert repacks.copy_bytes == sum(i.n_bytes for i in q4k) > 0
    assert (
        repacks.notice
        == f"--repack-experts: {repacks.copy_bytes >> 20} MiB of expert stacks repacked in host RAM (auto)"
    )
    weights = {i.name: repacks.weight(i) for i in expert_stacks}
    assert all((weights[i.name].repacked is not None) == (i.qtype.name == "Q4_K") for i in expert_stacks)
    assert sum(w.repacked.nbytes for w in weights.values() if w.repacked is not None) == repacks.copy_bytes


def test_auto_keeps_the_file_blocks_without_room_or_without_a_gpu(expert_stacks, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(repack, "meminfo", lambda: {"MemTotal": 16 * GiB, "MemAvailable": GiB})
    tight = ExpertRepacks(expert_stacks, "auto", on_gpu=True, threads=2)
    assert tight.notice.startswith("--repack-experts auto: the experts stay in the file mapping (")
    alone = ExpertRepacks(expert_stacks, "auto", on_gpu=False, threads=2)  # on the CPU alone: opt-in
    off = ExpertRepacks(expert_stacks, "off", on_gpu=True, threads=2)
    assert alone.notice == off.notice == ""
    for r in (tight, alone, off):
        assert all(r.weight(i).repacked is None for i in expert_stacks)
