"""One DMA for many equal rows at a pitch: ``cuMemcpy2DAsync`` through the CUDA driver.

Why: the staged path (:mod:`kvcentric.kernels.staged`) moves, per layer, one contiguous
span per store object between a device scratch (spans back to back) and the objects in
host memory (spans at the object stride). torch has no strided cross-device copy that
stays asynchronous (``copy_`` into a non-contiguous host tensor goes through a pageable
temporary), and one ``copy_`` per span costs a Python call and a launch each. The driver's
2-D copy moves ``height`` rows of ``width`` bytes between two pitches in one call, on the
copy engines, at the link's speed.

The driver library (``libcuda.so.1``, installed with the NVIDIA driver) is opened on the
first call; :func:`available` says whether it could be. Calls are enqueued on ``stream``
(a ``cudaStream_t``/``CUstream``, e.g. ``torch.cuda.current_stream().cuda_stream``) and
not synchronised; host memory must be page-locked (pinned or ``cudaHostRegister``-ed) for
the copy to be asynchronous.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

HOST, DEVICE = 1, 2  # CUmemorytype


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` (cuda.h)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


@dataclass(frozen=True)
class Rows:
    """``height`` rows of one side of a copy: the first row's address, the distance
    between rows (``pitch``, bytes) and whether they are in device memory."""

    ptr: int
    pitch: int
    on_device: bool


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    return lib


def _ensure_context(lib: ctypes.CDLL, device_index: int) -> None:
    """Make the device's primary context (the one the CUDA runtime, hence torch, uses)
    current on this thread if none is: a thread that has only used torch's cached
    allocations and streams may never have made a runtime call that binds it. The
    retain is never released, like the runtime's own."""
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return
    dev = ctypes.c_int()
    rc = lib.cuDeviceGet(ctypes.byref(dev), device_index)
    rc = rc or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value)
    rc = rc or lib.cuCtxSetCurrent(ctx)
    if rc != 0:
        raise RuntimeError(f"cannot bind CUDA device {device_index}'s context (CUresult {rc})")


def available() -> bool:
    """Whether the CUDA driver library can be opened in this process."""
    return _driver() is not None


def copy_rows(dst: Rows, src: Rows, width: int, height: int, stream: int,
              device_index: int) -> None:
    """Enqueue the copy of ``height`` rows of ``width`` bytes from ``src`` to ``dst`` on
    ``stream`` of device ``device_index`` (whose primary context is made current on this
    thread if none is). RuntimeError with the driver's error code when the driver
    refuses (bad pitch, unregistered pointer...)."""
    lib = _driver()
    if lib is None:
        raise RuntimeError("the CUDA driver library (libcuda.so.1) is not available")
    if width <= 0 or height <= 0:
        return
    if width > min(src.pitch, dst.pitch) and height > 1:
        raise ValueError(f"rows of {width} B overlap at pitches {src.pitch}/{dst.pitch}")
    _ensure_context(lib, device_index)
    p = _Memcpy2D(WidthInBytes=width, Height=height)
    for side, rows in (("src", src), ("dst", dst)):
        setattr(p, f"{side}MemoryType", DEVICE if rows.on_device else HOST)
        setattr(p, f"{side}Device" if rows.on_device else f"{side}Host", rows.ptr)
        setattr(p, f"{side}Pitch", rows.pitch)
    rc = lib.cuMemcpy2DAsync_v2(ctypes.byref(p), ctypes.c_void_p(stream))
    if rc != 0:
        raise RuntimeError(f"cuMemcpy2DAsync failed with CUresult {rc}")
