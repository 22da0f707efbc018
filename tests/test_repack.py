"""--repack-experts (weights/repack.py): the CPU expert stacks that ggml repacks are copied by a pool of threads
while loading, each handed out as its copy; without the flag, the file's blocks. That the copies give the
experts' products is tests/test_synth.py's (CPU) and tests/test_gpu_offload.py's (the captured step)."""

from __future__ import annotations

import threading

import ggml
import pytest

from tandem.gguf import open_gguf
from tandem.synth.writer import synthesize
from tandem.weights.repack import ExpertRepacks


@pytest.fixture(scope="module")
def expert_stacks(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The expert tensors of a 1-layer synthetic Qwen3-30B-A3B (gate and up Q4_K, down Q6_K or Q4_K)."""
    path = synthesize("qwen3-30b-a3b", tmp_path_factory.mktemp("repack") / "q.gguf", layers=1, fill="random").path
    f = open_gguf(path)
    yield [info for name, info in f.tensors.items() if "_exps." in name]
    path.unlink(missing_ok=True)  # 0.8 GB of disk


def test_the_q4k_stacks_are_repacked_on_a_pool(expert_stacks, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if not ggml.ggml_cpu_has_avx2():
        pytest.skip("ggml repacks Q4_K only with AVX2")
    from tandem.weights import repack

    threads = set()
    real = repack.repack_experts

    def recorded(w, cpu_only):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return real(w, cpu_only)

    monkeypatch.setattr(repack, "repack_experts", recorded)
    q4k = [i for i in expert_stacks if i.qtype.name == "Q4_K"]
    repacks = ExpertRepacks(expert_stacks, enabled=True, threads=2)
    assert repacks.copy_bytes == sum(i.n_bytes for i in q4k) > 0
    assert repacks.notice == (
        f"{repacks.copy_bytes >> 20} MiB of expert stacks repacked in host RAM for ggml's interleaved kernels"
    )
    weights = {i.name: repacks.weight(i) for i in expert_stacks}
    assert all((weights[i.name].repacked is not None) == (i.qtype.name == "Q4_K") for i in expert_stacks)
    assert sum(w.repacked.nbytes for w in weights.values() if w.repacked is not None) == repacks.copy_bytes
    assert threads and all(t.startswith("tandem-repack") for t in threads)


def test_without_the_flag_the_file_blocks(expert_stacks) -> None:  # type: ignore[no-untyped-def]
    repacks = ExpertRepacks(expert_stacks, enabled=False, threads=2)
    assert repacks.notice == "" and repacks.copy_bytes == 0
    for info in expert_stacks:
        w = repacks.weight(info)
        assert w.repacked is None and w.data is info.data


@pytest.mark.parametrize("flag, repacked", [(None, True), (True, True), (False, False)])
def test_a_model_on_the_cpu_repacks_by_default(tmp_path, flag, repacked) -> None:  # type: ignore[no-untyped-def]
    """Where the whole model computes on the CPU its expert stacks are repacked unless --no-repack-experts says not,
    as llama.cpp's CPU backend holds them (beside a GPU the default is off: tests/test_gpu_offload.py's runs)."""
    if not ggml.ggml_cpu_has_avx2():
        pytest.skip("ggml repacks Q4_K only with AVX2")
    import tandem

    path = synthesize("qwen3.6-35b-a3b", tmp_path / "q.gguf", layers=1, fill="random").path
    with tandem.LLM(path, device="cpu", n_ctx=64, threads=2, repack_experts=flag) as llm:
        notices = [n for n in llm.notices if "expert stacks repacked" in n]
        assert len(notices) == int(repacked), llm.notices
        logits = llm.engine.append([1, 2, 3])
        assert bool(logits.isfinite().all())


def test_mxfp4_stacks_only_with_the_whole_model_on_the_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """llama.cpp's CPU backend repacks MXFP4 expert stacks too, its --cpu-moe keeps them in the file (the repacked
    gemv quantizes the activations otherwise): tandem copies them where the whole model is on the CPU only."""
    path = synthesize("gpt-oss-20b", tmp_path / "g.gguf", layers=1, fill="random").path
    stacks = [info for name, info in open_gguf(path).tensors.items() if "_exps." in name]
    mxfp4 = [i for i in stacks if i.qtype.name == "MXFP4"]
    assert mxfp4
    beside_gpu = ExpertRepacks(stacks, enabled=True, threads=2)
    assert all(beside_gpu.weight(i).repacked is None for i in mxfp4)
    cpu_only = ExpertRepacks(stacks, enabled=True, threads=2, cpu_only=True)
    copies = [cpu_only.weight(i).repacked for i in mxfp4]
    if all(c is None for c in copies):
        pytest.skip("ggml does not repack MXFP4 on this CPU")
    assert all(c is not None for c in copies) and cpu_only.copy_bytes >= sum(i.n_bytes for i in mxfp4)
