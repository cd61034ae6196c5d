"""CPU host KV pools whose layout code is SGLang's own, for the HiCache backend tests.

Why not the real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``: on this CPU-only
environment ``sglang.srt.mem_cache.pool_host`` cannot be imported. Its package imports
``memory_pool``, which imports ``sglang.srt.configs`` and so ``torchvision`` (PyPI only has
CUDA builds of it; against the CPU torch its ops fail to register, "operator
torchvision::nms does not exist", which also breaks ``transformers``) and then SGLang's
MoE / DeepGEMM layers. So the pool classes cannot be constructed here.

What this module does instead: it compiles the layout methods of those classes straight
from the installed SGLang sources (``init_kv_buffer``, ``get_page_buffer_meta``,
``get_data_page``, ``set_from_flat_data_page``, ``get_dummy_flat_data_page``, ...,
and ``HostKVCache.logical_page_size``) and binds them to a small class holding the
attributes ``HostKVCache.__init__`` would set. Buffer shapes, page pointers and sizes are
therefore exactly SGLang's, and follow SGLang when it changes them.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import torch

_MHA = ("MHATokenToKVPoolHost", "mha.py", (
    "init_kv_buffer", "get_page_buffer_meta", "get_data_page", "get_dummy_flat_data_page",
    "set_from_flat_data_page", "get_size_per_token", "get_ksize_per_token",
    "get_hybrid_pool_buffer", "k_buffer", "v_buffer"))
_MLA = ("MLATokenToKVPoolHost", "mla.py", (
    "init_kv_buffer", "get_page_buffer_meta", "get_data_page", "get_dummy_flat_data_page",
    "set_from_flat_data_page", "get_size_per_token", "get_ksize_per_token",
    "_storage_page_index"))
_BASE = ("HostKVCache", "base.py", ("logical_page_size", "logical_size"))


def _pool_host_dir() -> Path:
    spec = importlib.util.find_spec("sglang.srt.mem_cache")  # importable: no torchvision
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "pool_host"


def _alloc_cpu(dims: tuple[int, ...], dtype: torch.dtype, device: str, pin_memory: bool,
               allocator: Any, registration_granularity_bytes: int | None = None
               ) -> torch.Tensor:
    # SGLang's allocator pins/registers host memory for a GPU; plain CPU memory here.
    return torch.zeros(dims, dtype=dtype, device=device)


def real_methods(class_name: str, file_name: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The named methods of ``class_name``, compiled from SGLang's installed source."""
    path = _pool_host_dir() / file_name
    tree = ast.parse(path.read_text(), str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    defs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {d.name for d in defs}
    assert not missing, f"SGLang's {class_name} has no {sorted(missing)}"
    future = ast.parse("from __future__ import annotations").body  # as in SGLang's files
    code = compile(ast.Module(body=[*future, *defs], type_ignores=[]), str(path), "exec",
                   dont_inherit=True)
    ns: dict[str, Any] = {"torch": torch, "ALLOC_MEMORY_FUNCS": {"cpu": _alloc_cpu}}
    exec(code, ns)
    return {name: ns[name] for name in names}


def make_pool(mla: bool, layout: str, *, layers: int = 3, page_size: int = 8, pages: int = 12,
              heads: int = 2, head_dim: int = 16, kv_lora_rank: int = 24, rope_dim: int = 8,
              dtype: torch.dtype = torch.float16) -> Any:
    """A zero-filled host pool of ``pages`` pages, SGLang geometry and layout code."""
    cls_name, file_name, names = _MLA if mla else _MHA
    methods = {**real_methods(*_BASE), **real_methods(cls_name, file_name, names)}
    pool = type(f"Cpu{cls_name}", (), methods)()
    pool.layout, pool.page_size, pool.page_num = layout, page_size, pages
    pool.size, pool.layer_num, pool.dtype = pages * page_size, layers, dtype
    pool.device, pool.pin_memory, pool.allocator = "cpu", False, None
    pool._transfer_device = torch.device("cpu")
    pool.dcp_size, pool.dcp_rank, pool.start_layer, pool.end_layer = 1, 0, 0, layers
    if mla:
        pool.kv_lora_rank, pool.qk_rope_head_dim = kv_lora_rank, rope_dim
        pool.kv_cache_dim = kv_lora_rank + rope_dim
        pool._size_per_token = pool.kv_cache_dim * dtype.itemsize * layers
    else:
        pool.head_num, pool.head_dim, pool.v_head_dim = heads, head_dim, head_dim
    pool.kv_buffer = pool.init_kv_buffer()
    return pool


def fill_pages(pool: Any, pages: list[int], seed: int) -> None:
    """Write seed-determined random bytes into every byte of ``pages`` (page numbers)."""
    gen = torch.Generator().manual_seed(seed)
    for p in pages:
        page = pool.get_data_page(p * pool.page_size, flat=True)
        data = torch.randint(0, 256, (page.numel() * page.element_size(),), generator=gen,
                             dtype=torch.uint8)
        pool.set_from_flat_data_page(p * pool.page_size, data.view(pool.dtype))


def page_bytes(pool: Any, page: int) -> bytes:
    """The bytes of one page in SGLang's flat data-page order."""
    flat = pool.get_data_page(page * pool.page_size, flat=True).contiguous()
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def indices(pool: Any, pages: list[int]) -> torch.Tensor:
    """Host indices SGLang passes for ``pages``: ``page_size`` per page."""
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size)
                      for p in pages]).to(torch.int64)
