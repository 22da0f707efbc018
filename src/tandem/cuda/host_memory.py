"""Page-locked host memory for the transfers between host RAM and the GPU.

A copy from pageable memory goes through the driver's own bounce buffers and blocks the host; from
page-locked memory it is a DMA that runs at PCIe speed, asynchronously, and may be captured in a CUDA
graph. Three uses:
- the small exchange buffers of a host op (hidden states to the CPU experts and back): torch's pinned
  tensors, allocated once and kept by their op (torch allows captured copies only from those);
- the memory-mapped GGUF bytes of CPU-resident experts, registered in place (no copy, no VRAM), so that
  prefill can stream them to the GPU at full PCIe speed;
- the same registered blocks read by GPU kernels in place (`device_view`, `--pcie-experts`).

The registration goes through the driver API (cuMemHostRegister): a refusal returns an error code there
and leaves no sticky error in the runtime that torch's next CUDA call would report as its own.
"""

from __future__ import annotations

import ctypes
import functools
import time
import weakref

import torch

PAGE = 4096
_REGISTER_PORTABLE = 0x01
_REGISTER_READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY: for read-only mappings such as the GGUF file


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    return lib


class HostRegistration:
    """A registered (page-locked) host range; unregistered by `close()` or when garbage collected."""

    def __init__(self, ptr: int, n_bytes: int, owner: object) -> None:
        self.ptr = ptr
        self.n_bytes = n_bytes
        # The finalizer holds `owner` (the memory's owner: an array over the file mapping, a tensor), so the
        # memory cannot be unmapped or freed while it is still registered.
        self._finalizer = weakref.finalize(self, _unregister, ptr, owner)

    def close(self) -> None:
        self._finalizer()


def _unregister(ptr: int, owner: object) -> None:
    try:
        _driver().cuMemHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the driver releases it with the process
        pass


def register_host(
    ptr: int, n_bytes: int, read_only: bool, owner: object, device: torch.device
) -> HostRegistration | str:
    """Page-lock [ptr, ptr + n_bytes) (widened to whole pages, which must belong to `owner`'s memory) for
    copies to `device`. Returns the registration, or the driver's error name when it refuses (the caller
    then keeps pageable copies)."""
    torch.empty(1, device=device)  # the device's context is current on this thread (the driver API needs it)
    start = ptr - ptr % PAGE
    end = -(-(ptr + n_bytes) // PAGE) * PAGE
    lib = _driver()
    errors = []
    # Read-only first where the memory is read-only (not every platform supports the flag), then plain.
    for flags in ([_REGISTER_PORTABLE | _REGISTER_READ_ONLY] if read_only else []) + [_REGISTER_PORTABLE]:
        err = lib.cuMemHostRegister_v2(start, end - start, flags)
        if err == 0:
            return HostRegistration(start, end - start, owner)
        name = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(name))
        errors.append(f"flags {flags}: {(name.value or b'?').decode()}")
    return "; ".join(errors)


class _DeviceAddress:
    """A device address range as torch reads it (__cuda_array_interface__); holds the host memory's owner."""

    def __init__(self, ptr: int, n_bytes: int, owner: object) -> None:
        self.__cuda_array_interface__ = {"shape": (n_bytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        self.owner = owner


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-locked host bytes (a registered range or pinned memory) as a CUDA uint8 tensor on `device`: kernels
    read them over PCIe, where they are; nothing is copied and no VRAM is taken. The view holds `host`."""
    lib = _driver()
    ptr = ctypes.c_uint64()
    with torch.cuda.device(device):
        err = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(ptr), ctypes.c_void_p(host.data_ptr()), 0)
    if err != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(name))
        raise RuntimeError(f"cuMemHostGetDevicePointer failed: {(name.value or b'?').decode()}")
    return torch.as_tensor(_DeviceAddress(ptr.value, host.numel() * host.element_size(), host), device=device)


class HostCopies:
    """Copies from page-locked host memory to the GPU issued from the host while the GPU may be replaying a
    graph: the driver's cuMemcpyHtoDAsync on a stream of their own, a few microseconds each (a torch copy
    costs several times that in Python), and a wait for all of them."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.lib = _driver()
        self.copy = self.lib.cuMemcpyHtoDAsync_v2
        self.copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.copy.restype = ctypes.c_int
        self.sync = self.lib.cuStreamSynchronize
        self.sync.argtypes = [ctypes.c_void_p]
        self.sync.restype = ctypes.c_int
        self.stream = stream
        self.handle = ctypes.c_void_p(stream.cuda_stream)

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(err, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()}")

    def enqueue(self, dst: int, src: int, n_bytes: int) -> None:
        """Copy n_bytes from host address src (page-locked) to device address dst, in stream order."""
        self._check(self.copy(dst, src, n_bytes, self.handle), "cuMemcpyHtoDAsync")

    def wait(self) -> None:
        """Until every copy enqueued so far has landed."""
        self._check(self.sync(self.handle), "cuStreamSynchronize")


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked CPU tensor from torch's pinned allocator."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


_WAIT_VALUE_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ


class HostFlag:
    """A page-locked int32 set by one side and waited for by the other: the host sets it and a stream waits for
    it on the device, or a stream sets it and the host spins on it (the driver's stream memory operations,
    cuStreamWaitValue32 / cuStreamWriteValue32, which CUDA graphs capture as nodes).

    With a pair of them per host op, the whole decode step is ONE captured graph: the graph sets the op's
    to-host flag once its inputs are in host memory and waits for its to-device flag before copying the result
    back; the host spins on the first, computes, sets the second (cuda/graphs.py SegmentedGraph).
    """

    def __init__(self) -> None:
        self.tensor = pinned_empty((1,), torch.int32).zero_()
        self._value = self.tensor.numpy()  # loads and stores from Python go straight to the page-locked word
        self._lib = _memops()

    def enqueue_set(self, stream: torch.cuda.Stream) -> None:
        """On `stream`: set the flag, after the stream's earlier work (its copies to host memory included:
        the driver fences them first)."""
        handle, ptr = ctypes.c_void_p(stream.cuda_stream), self.tensor.data_ptr()
        _check(self._lib, self._lib.write_value(handle, ptr, 1, 0), "cuStreamWriteValue32")

    def enqueue_wait_and_clear(self, stream: torch.cuda.Stream) -> None:
        """On `stream`: wait until the flag is set, then clear it (for the next replay)."""
        handle, ptr = ctypes.c_void_p(stream.cuda_stream), self.tensor.data_ptr()
        _check(self._lib, self._lib.wait_value(handle, ptr, 1, _WAIT_VALUE_EQ), "cuStreamWaitValue32")
        _check(self._lib, self._lib.write_value(handle, ptr, 0, 0), "cuStreamWriteValue32")

    def wait_and_clear(self, timeout_s: float) -> None:
        """On the host: spin until the device set the flag, then clear it. A GPU that does not get there in
        `timeout_s` (a fault, a hang) is an error rather than a hang."""
        value = self._value
        if value[0]:
            value[0] = 0
            return
        deadline = time.monotonic() + timeout_s
        while not value[0]:
            for _ in range(1000):
                if value[0]:
                    break
            else:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the GPU did not reach a host op in {timeout_s:.0f} s")
        value[0] = 0

    def set(self) -> None:
        """Release the stream waiting for this flag. The host's earlier stores (the host op's output) are
        visible to the device before this one: x86 keeps stores in order."""
        self._value[0] = 1

    def clear(self) -> None:
        self._value[0] = 0


class _MemOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        # The _v2 entry points are the ones available by default (the legacy ones need a module parameter).
        self.wait_value = lib.cuStreamWaitValue32_v2
        self.write_value = lib.cuStreamWriteValue32_v2
        for fn in (self.wait_value, self.write_value):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int


_MEMOPS: list[_MemOps] = []


def _memops() -> _MemOps:
    if not _MEMOPS:
        _MEMOPS.append(_MemOps(_driver()))
    return _MEMOPS[0]


def _check(ops: _MemOps, err: int, what: str) -> None:
    if err != 0:
        name = ctypes.c_char_p()
        ops.lib.cuGetErrorName(err, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()}")


@functools.cache
def host_flags_work(device_index: int) -> bool:
    """Whether this driver runs the stream memory operations HostFlag needs (checked once per device, outside
    any capture, on a side stream: set from the device, waited for, cleared)."""
    try:
        flag = HostFlag()
        stream = torch.cuda.Stream(device_index)
        flag.enqueue_set(stream)
        flag.enqueue_wait_and_clear(stream)
        stream.synchronize()
        return int(flag.tensor[0]) == 0
    except (OSError, AttributeError, RuntimeError):
        return False
