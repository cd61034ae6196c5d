"""The CUDA data path's CPU-testable parts: per-page DMA pieces, the host pinner's
contract with the stores (registered on map, unregistered before unmap, again after a
coordinator restart, refusals counted), and the device path a CPU worker gets. The CUDA
runs of the same code are in ``tests/gpu/``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.device_path import DevicePath
from kvcentric.cuda import HostPinner
from kvcentric.cuda.pinning import REGISTER_FLAGS, CudaRuntime
from kvcentric.kernels.dma import pieces
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from tests.helpers.waiting import wait_until


def mapped(ptr: int) -> bool:
    """Whether ``ptr`` lies in one of this process's mappings (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= ptr < hi:
            return True
    return False


class DriverLog:
    """A CUDA runtime stand-in for a machine without a GPU: records each call and whether
    the range was still mapped at that moment; ``fail`` makes registration fail."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int, bool]] = []
        self.fail = fail

    def runtime(self) -> CudaRuntime:
        return CudaRuntime(self._register, self._unregister)

    def _register(self, ptr: int, size: int, flags: int) -> int:
        assert flags == REGISTER_FLAGS and size > 0
        self.calls.append(("register", ptr, mapped(ptr)))
        return 2 if self.fail else 0  # cudaErrorMemoryAllocation

    def _unregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, mapped(ptr)))
        return 0


@pytest.mark.parametrize(("shape", "dim", "count"), [
    ((2, 7, 4, 2, 8), 1, 2),     # FlashAttention: K and V of a block
    ((7, 4, 2, 8), 0, 1),        # NHD: one contiguous page
    ((7, 2, 2, 2, 2, 3), 0, 1),  # too many pieces after a permute: one strided copy
])
def test_dma_pieces_cover_a_block(shape: tuple[int, ...], dim: int, count: int) -> None:
    layer = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    if count == 1 and len(shape) == 6:
        layer = layer.permute(0, 5, 4, 3, 2, 1)
    block = layer.select(dim, 3)
    row = torch.empty(block.shape)
    parts = list(pieces(block, row))
    assert len(parts) == count
    for src, dst in parts:
        dst.copy_(src)
    assert torch.equal(row, block)


def test_pinner_without_cuda_refuses_and_counts() -> None:
    pinner = HostPinner(None)
    assert not pinner.enabled or torch.cuda.is_available()
    if pinner.enabled:
        pytest.skip("this machine has CUDA (see tests/gpu)")
    buf = torch.empty(4096, dtype=torch.uint8)
    assert pinner.register(buf.data_ptr(), 4096) is False
    assert pinner.refused == 1 and pinner.registered_bytes == 0
    with pytest.raises(ValueError):
        pinner.register(buf.data_ptr(), 0)


def test_local_store_arena_registered_then_unregistered_before_unmap(
        store_cfg: StoreConfig) -> None:
    log = DriverLog()
    pinner = HostPinner(log.runtime())
    store = open_store(replace(store_cfg, reconnect_interval_s=0.1))
    store.pin_host_memory(pinner)
    assert pinner.registered_bytes == store_cfg.local.capacity_bytes
    (kind, first, was_mapped), = log.calls
    assert kind == "register" and was_mapped
    # a restarted coordinator makes a new arena: the old one is unregistered while still
    # mapped, the new one registered, before any slot points into it
    launcher.stop(store_cfg)
    src = torch.arange(64, dtype=torch.uint8)
    assert wait_until(lambda: store.batch_put_from(["k"], [src.data_ptr()], [64]) == [0], 30)
    kinds = [(k, m) for k, _, m in log.calls]
    assert kinds == [("register", True), ("unregister", True), ("register", True)]
    assert log.calls[1][1] == first and pinner.registered_bytes == store_cfg.local.capacity_bytes
    store.close()
    assert log.calls[-1][0] == "unregister" and log.calls[-1][2]  # still mapped then
    assert pinner.registered_bytes == 0


def test_refused_registration_keeps_the_store_working(store_cfg: StoreConfig) -> None:
    log = DriverLog(fail=True)
    pinner = HostPinner(log.runtime())
    with open_store(store_cfg) as store:
        store.pin_host_memory(pinner)
        assert pinner.refused == 1 and pinner.registered_bytes == 0
        src = torch.arange(256, dtype=torch.uint8)
        assert store.batch_put_from(["a"], [src.data_ptr()], [256]) == [0]
        dst = torch.zeros(256, dtype=torch.uint8)
        assert store.batch_get_into(["a"], [dst.data_ptr()], [256]) == [256]
        assert torch.equal(src, dst)
    assert [k for k, _, _ in log.calls] == ["register"]  # nothing to unregister


def test_cpu_device_path_has_no_streams_or_pinning(store_cfg: StoreConfig) -> None:
    with open_store(store_cfg) as store:
        path = DevicePath.open(torch.empty(2, 10, 16, 2, 8), 16 * 2 * 8 * 4 * 2, store)
    assert path.ordering is None and path.pinner is None
    assert path.kernel.block_dim == 1 and path.kernel.pack_impl == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_gpu_benchmark_refuses_clearly_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.micro import gpu_path

    assert gpu_path.main(["--quick"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
