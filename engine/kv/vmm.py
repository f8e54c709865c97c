"""VirtualRange: device memory whose address never moves while its physical backing grows and
shrinks (the CUDA driver's virtual memory management, through ``ctypes`` on ``libcuda``).

The KV pool lives in one (engine/kv/page_memory.py). A range of virtual addresses as large as
the budget is reserved once (``cuMemAddressReserve``: no memory yet); physical chunks
(``cuMemCreate``, a multiple of the allocation granularity, 2 MiB on Hopper) are mapped at its
start as the pool grows and unmapped from its end as it shrinks. The tensor over the range, the
per-model K/V views over that tensor and the CUDA graphs captured on them keep their addresses
through every change, so a resize rebuilds no runner and copies no page: a load may take the
pool's free tail while every model serves.

Nothing may touch an unmapped address: the pool hands out only pages below its mapped size, and
a shrink waits for the device to finish what is queued (a step still reading a page being cut
would fault) before it unmaps.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

import torch

from engine.errors import EngineError

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
_CU_ERROR_OUT_OF_MEMORY = 2


class VmmError(EngineError):
    """A driver call of the virtual range failed (``out_of_memory`` when it was a mapping)."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib: Any = None
_lib_lock = threading.Lock()


def _driver() -> Any:
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise VmmError(f"the CUDA driver library cannot be opened: {e}") from None
            u64, size_t = ctypes.c_uint64, ctypes.c_size_t
            sigs = {
                "cuMemGetAllocationGranularity": [ctypes.POINTER(size_t), ctypes.POINTER(_AllocationProp), ctypes.c_int],
                "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, ctypes.c_ulonglong],
                "cuMemAddressFree": [u64, size_t],
                "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.POINTER(_AllocationProp), ctypes.c_ulonglong],
                "cuMemRelease": [u64],
                "cuMemMap": [u64, size_t, size_t, u64, ctypes.c_ulonglong],
                "cuMemUnmap": [u64, size_t],
                "cuMemSetAccess": [u64, size_t, ctypes.POINTER(_AccessDesc), size_t],
                "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
                "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
                "cuCtxSetCurrent": [ctypes.c_void_p],
                "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
                "cuMemsetD8Async": [u64, ctypes.c_ubyte, size_t, ctypes.c_void_p],
            }
            for name, args in sigs.items():
                fn = getattr(lib, name)
                fn.argtypes = args
                fn.restype = ctypes.c_int
            _lib = lib
        return _lib


def _check(rc: int, what: str) -> None:
    if rc == 0:
        return
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(rc, ctypes.byref(name))
    label = name.value.decode() if name.value else f"error {rc}"
    raise VmmError(f"{what}: {label}", out_of_memory=rc == _CU_ERROR_OUT_OF_MEMORY)


def _current_context(device_index: int) -> None:
    """The device's primary context current on this thread (torch's runtime calls make it so on
    the threads that used it; a thread that did not, e.g. a load thread's first call, gets it
    here)."""
    lib = _driver()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device_index), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class _ArrayInterface:
    """What ``torch.as_tensor`` reads a device pointer from; the tensor keeps it alive, and it
    keeps the range alive, so the addresses outlive every view of them."""

    def __init__(self, owner: VirtualRange) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (owner.reserved,), "typestr": "|u1", "version": 3,
                                         "data": (owner.base, False), "strides": None, "stream": None}


class VirtualRange:
    """``reserve`` bytes of addresses on ``device`` (rounded up to chunks), of which the first
    ``mapped`` bytes have memory. ``chunk``: the unit of mapping (rounded up to the driver's
    granularity)."""

    def __init__(self, device: torch.device, reserve: int, chunk: int = 64 << 20) -> None:
        if device.type != "cuda":
            raise VmmError(f"a virtual range needs a CUDA device, not {device}")
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        _current_context(self.index)
        lib = _driver()
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.index)
        gran = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self._prop),
                                                 _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")
        self.granularity = int(gran.value)
        self.chunk = -(-max(chunk, 1) // self.granularity) * self.granularity
        self.reserved = -(-max(reserve, 1) // self.chunk) * self.chunk
        base = ctypes.c_uint64()
        _check(lib.cuMemAddressReserve(ctypes.byref(base), self.reserved, 0, 0, 0), "cuMemAddressReserve")
        self.base = int(base.value)
        self._handles: list[int] = []  # chunk i is mapped at base + i * chunk
        self._lock = threading.Lock()
        # Everything goes back when the range is collected (the last view of it gone) or closed.
        self._release = weakref.finalize(self, _release, self.index, self.base, self.reserved, self.chunk,
                                         self._handles)
        self._release.atexit = False  # at exit the driver takes it all back with the context

    @property
    def mapped(self) -> int:
        return len(self._handles) * self.chunk

    def tensor(self) -> torch.Tensor:
        """``uint8 [reserved]`` over the whole range (it keeps the range alive); only its first
        ``mapped`` bytes may be touched. Made while some memory is mapped: torch asks the driver
        which device the address is on."""
        if not self._handles:
            raise VmmError("a tensor over a virtual range needs some of it mapped first")
        return torch.as_tensor(_ArrayInterface(self), device=self.device)

    def map_to(self, nbytes: int) -> int:
        """Back at least the first ``nbytes`` (whole chunks) and no more; returns the bytes mapped.
        Growing zeroes the new chunks (on the current stream). Shrinking synchronizes the device
        first: work queued on the chunks being cut must end before they go. A mapping that runs
        out of memory raises :class:`VmmError` (``out_of_memory``) with the range as it was."""
        if nbytes < 0 or nbytes > self.reserved:
            raise VmmError(f"{nbytes} bytes is outside the reserved range of {self.reserved}")
        want = -(-nbytes // self.chunk)
        with self._lock:
            _current_context(self.index)
            have = len(self._handles)
            if want > have:
                self._grow(have, want)
                n = (want - have) * self.chunk
                _check(_driver().cuMemsetD8Async(self.base + have * self.chunk, 0, n,
                                                  ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)),
                       "cuMemsetD8Async")
            elif want < have:
                torch.cuda.synchronize(self.device)
                _unmap(self.base, self.chunk, self._handles, want)
            return self.mapped

    def _grow(self, have: int, want: int) -> None:
        lib = _driver()
        try:
            for i in range(have, want):
                handle = ctypes.c_uint64()
                _check(lib.cuMemCreate(ctypes.byref(handle), self.chunk, ctypes.byref(self._prop), 0), "cuMemCreate")
                try:
                    _check(lib.cuMemMap(self.base + i * self.chunk, self.chunk, 0, handle.value, 0), "cuMemMap")
                except VmmError:
                    lib.cuMemRelease(handle.value)
                    raise
                self._handles.append(int(handle.value))
            # One access grant over every chunk just mapped (the driver takes a range spanning
            # several mappings): a first pool of ~900 chunks made a third of its driver calls here.
            access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.index), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            _check(lib.cuMemSetAccess(self.base + have * self.chunk, (want - have) * self.chunk,
                                      ctypes.byref(access), 1), "cuMemSetAccess")
        except VmmError:
            _unmap(self.base, self.chunk, self._handles, have)  # all or nothing
            raise

    def close(self) -> None:
        """Unmap and release everything and give the addresses back now. Only once nothing will
        touch them again (no view in use, no graph captured on them replayed)."""
        self._release()


def _unmap(base: int, chunk: int, handles: list[int], keep: int) -> None:
    lib = _driver()
    while len(handles) > keep:
        i = len(handles) - 1
        _check(lib.cuMemUnmap(base + i * chunk, chunk), "cuMemUnmap")
        _check(lib.cuMemRelease(handles.pop()), "cuMemRelease")


def _release(index: int, base: int, reserved: int, chunk: int, handles: list[int]) -> None:
    _current_context(index)
    if handles:
        torch.cuda.synchronize(torch.device("cuda", index))
        _unmap(base, chunk, handles, 0)
    _check(_driver().cuMemAddressFree(base, reserved), "cuMemAddressFree")
