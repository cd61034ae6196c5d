"""Move KV between vLLM's paged KV cache and contiguous store objects.

Public API (see :mod:`kvcentric.kernels.dispatch` for the full contracts):

* :func:`pack_blocks` / :func:`unpack_blocks`: one layer, ``out[i]`` = block
  ``block_ids[i]`` with the block dim moved first, and back;
* :func:`pack_blocks_layers` / :func:`unpack_blocks_layers`: one row holds a
  block of every layer, ``out[i, l]`` = block ``block_ids[i]`` of ``layers[l]``;
* :func:`as_rows`: view a uint8 byte buffer (store object memory) as typed rows;
* :func:`explain_impl`: which implementation (torch / Triton) would run.

Importing this package imports torch only; Triton is imported on the first
Triton launch.
"""

from kvcentric.kernels.dispatch import (
    IMPLS,
    ImplChoice,
    PagedCopy,
    explain_impl,
    pack_blocks,
    pack_blocks_layers,
    triton_available,
    triton_interpret_enabled,
    unpack_blocks,
    unpack_blocks_layers,
)
from kvcentric.kernels.reference import pack_reference, unpack_reference
from kvcentric.kernels.tensor_views import as_rows

__all__ = [
    "IMPLS",
    "ImplChoice",
    "PagedCopy",
    "as_rows",
    "explain_impl",
    "pack_blocks",
    "pack_blocks_layers",
    "pack_reference",
    "triton_available",
    "triton_interpret_enabled",
    "unpack_blocks",
    "unpack_blocks_layers",
    "unpack_reference",
]
