"""Creating a Mooncake client (``mooncake.store.MooncakeDistributedStore``) from settings,
and the limits its calls need.

Imports of the wheel happen here, at open time, never at import of kvcentric: the
package works without Mooncake until a ``mooncake`` store is opened.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvcentric.store.base import StoreUnavailable
from kvcentric.store.mooncake.config import MooncakeSettings

log = logging.getLogger("kvcentric.store")
# buffers per scatter/gather call: one call with 4096 slices of 16 KiB over tcp wedged the
# 0.3.13 transfer engine (60 s timeout, then TRANSFER_FAIL for later transfers too)
MAX_SLICES = 1024


def check_installed() -> None:
    """Raise a clear :class:`~kvcentric.extras.MissingExtra` (an ``ImportError``) when the
    wheel or its system libraries are missing."""
    from kvcentric.extras import MissingExtra, install_hint

    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:  # the wheel, or its RDMA user-space libraries
        raise MissingExtra(
            f"the mooncake backend needs the Mooncake wheel ({install_hint('mooncake')}) "
            "and libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 (apt): "
            f"{exc}") from exc


def join(s: MooncakeSettings, protocol: str, devices: str) -> tuple[Any, Any]:
    """A set-up client and the ``ReplicateConfig`` its puts use; raises
    ``StoreUnavailable`` when setup fails (Mooncake retries ~90 s first when the master
    does not answer, so callers check the master's port before)."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    client = MooncakeDistributedStore()
    rc = client.setup(s.local_hostname, s.metadata_server, s.global_segment_size,
                      s.local_buffer_size, protocol, devices, s.master_server_address,
                      None, bool(s.ssd_offload_path), s.ssd_offload_path, s.tenant_id)
    if rc != 0:  # a client whose setup failed must not be used (it crashes)
        hint = (" (a client with ssd_offload_path needs a master run with --enable_offload,"
                " e.g. kvcentric store mooncake-master --offload)" if s.ssd_offload_path else "")
        raise StoreUnavailable(f"cannot join mooncake at {s.master_server_address} "
                               f"(metadata {s.metadata_server}, {protocol}): {rc}{hint}")
    log.info("mooncake client up: master %s, %s, segment %d B, staging %d B",
             s.master_server_address, protocol, s.global_segment_size, s.staging_size)
    replicate = ReplicateConfig()
    replicate.replica_num = s.replica_num
    if s.preferred_segment:  # "local": this client's own segment
        replicate.preferred_segment = (client.get_hostname() if s.preferred_segment == "local"
                                       else s.preferred_segment)
    return client, replicate


def chunks(ptr_lists: Sequence[Sequence[int]]) -> list[slice]:
    """Consecutive key ranges of at most ``MAX_SLICES`` buffers (an object with more is a
    range of its own)."""
    out, start, count = [], 0, 0
    for i, ptrs in enumerate(ptr_lists):
        if count and count + len(ptrs) > MAX_SLICES:
            out.append(slice(start, i))
            start, count = i, 0
        count += len(ptrs)
    if start < len(ptr_lists):
        out.append(slice(start, len(ptr_lists)))
    return out
