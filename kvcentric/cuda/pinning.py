"""Page-lock and map host memory for the GPU (``cudaHostRegister``).

Why: a copy between HBM and *pageable* host memory is staged by the driver through a
bounce buffer, blocks the host and runs at a fraction of PCIe bandwidth; and a Triton
kernel can only address host memory that is registered (mapped into the device's address
space, which under UVA is the same address). The store's memory (the local store's shared
arena, Mooncake's staging arena) is mapped by the store, not allocated by torch, so it is
registered here, once per process and mapping.

Contract: :meth:`HostPinner.register` never raises: on a CPU-only process, or when the
driver refuses (too much locked memory, a mapping it cannot pin), it logs once, counts the
refusal and returns False, and the caller keeps working on pageable memory (the kernels
then fall back to torch copies). A registered range must be unregistered *before* it is
unmapped (:meth:`unregister`); :meth:`close` unregisters whatever is left.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("kvcentric.cuda")

# cudaHostRegisterPortable (every context) | cudaHostRegisterMapped (device-addressable)
REGISTER_FLAGS = 0x01 | 0x02


@dataclass(frozen=True)
class CudaRuntime:
    """The two runtime calls this module makes; each returns a ``cudaError_t`` as int."""

    host_register: Callable[[int, int, int], int]
    host_unregister: Callable[[int], int]

    @classmethod
    def from_torch(cls) -> CudaRuntime:
        """torch's own cudart bindings (no extra dependency). Raises when torch has no CUDA."""
        rt = torch.cuda.cudart()
        return cls(lambda p, n, f: int(rt.cudaHostRegister(p, n, f)),
                   lambda p: int(rt.cudaHostUnregister(p)))


class HostPinner:
    """Registers host ranges with CUDA and remembers them (thread-safe).

    ``runtime`` defaults to torch's cudart when CUDA is available; without CUDA every
    :meth:`register` is a counted no-op that returns False.
    """

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        if runtime is None and torch.cuda.is_available():
            runtime = CudaRuntime.from_torch()
        self._rt = runtime
        self._lock = threading.Lock()
        self._ranges: dict[int, int] = {}  # ptr -> size
        self.refused = 0
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._rt is not None

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(self._ranges.values())

    def is_registered(self, ptr: int) -> bool:
        with self._lock:
            return ptr in self._ranges

    def register(self, ptr: int, size: int) -> bool:
        """Page-lock and map ``size`` bytes at ``ptr``; True when they are registered now
        (also when they already were). Slow for large ranges (the driver pins every page:
        roughly a second per tens of GiB), so call it once per mapping, off the hot path."""
        if size <= 0:
            raise ValueError(f"cannot register {size} bytes")
        with self._lock:
            if ptr in self._ranges:
                return True
            if self._rt is None:
                return self._refuse(ptr, size, "CUDA is not available")
            rc = self._rt.host_register(ptr, size, REGISTER_FLAGS)
            if rc != 0:
                return self._refuse(ptr, size, f"cudaHostRegister returned error {rc}")
            self._ranges[ptr] = size
        log.info("registered %.1f MiB of host memory at %#x with CUDA", size / 2**20, ptr)
        return True

    def _refuse(self, ptr: int, size: int, why: str) -> bool:
        self.refused += 1
        level = logging.DEBUG if self._rt is None or self._warned else logging.WARNING
        self._warned = self._warned or self._rt is not None
        log.log(level, "host memory at %#x (%d B) stays pageable: %s; GPU copies to and "
                "from it are staged by the driver", ptr, size, why)
        return False

    def unregister(self, ptr: int) -> None:
        """Undo :meth:`register` for the range starting at ``ptr`` (unknown: ignored).
        Must run before the range is unmapped."""
        with self._lock:
            if self._ranges.pop(ptr, None) is None or self._rt is None:
                return
            rc = self._rt.host_unregister(ptr)
        if rc != 0:
            log.warning("cudaHostUnregister(%#x) returned error %d", ptr, rc)

    def close(self) -> None:
        """Unregister every range still registered."""
        with self._lock:
            ptrs = list(self._ranges)
        for ptr in ptrs:
            self.unregister(ptr)
