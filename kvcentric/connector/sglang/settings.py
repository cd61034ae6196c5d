"""Settings of the SGLang HiCache backend, parsed once from SGLang's extra config.

SGLang passes ``--hicache-storage-backend-extra-config`` as one dict that also carries
the factory's own keys (``backend_name``, ``module_path``, ``class_name``,
``interface_v1``) and SGLang's prefetch knobs (``prefetch_threshold``, ...), which SGLang
parses leniently. kvcentric's options therefore sit under one ``"kvcentric"`` key, parsed
strictly (an unknown or misspelt option is a ``ValueError`` at start-up, not a silently
ignored one); every other key is SGLang's::

    {"backend_name": "kvcentric", "module_path": "kvcentric.connector.sglang",
     "class_name": "KVCentricHiCacheStorage", "interface_v1": 1,
     "kvcentric": {"store": {"backend": "local", "name": "sglang", "capacity": "32gb"},
                   "model_id": "llama-3-8b"}}

The options' earlier place, at the top level, is refused with a message saying where
they go now.

``store`` is the :class:`~kvcentric.config.StoreConfig` every kvcentric connector takes,
disk tier included: ``"disk": {"path": "/mnt/nvme/kvc", "capacity": "1tb"}`` in it gives
the local store an SSD tier behind its DRAM, where pages evicted from DRAM stay findable
and loadable (tests/connector/test_sglang_disk.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcentric.config import StoreConfig, parse_bool, parse_fields

SECTION = "kvcentric"  # the extra config's key holding kvcentric's options
LEGACY_KEYS = ("store", "model_id", "reopen_interval_s")  # their place before SECTION


@dataclass(frozen=True)
class SGLangSettings:
    """What the backend needs beyond SGLang's ``HiCacheStorageConfig``.

    Fields:
        store: which store to open (see :class:`kvcentric.config.StoreConfig`).
        model_id: namespace of the keys; ``None`` uses SGLang's ``model_name``. Instances
            that should share KV must agree on it.
        v1: SGLang uses the zero-copy ``batch_get_v1`` / ``batch_set_v1`` interface
            (``"interface_v1": 1``); informational, both interfaces share objects.
        reopen_interval_s: after the store could not be opened, wait this long before the
            next attempt (calls in between fail fast and SGLang recomputes).
    """

    store: StoreConfig = field(default_factory=StoreConfig)
    model_id: str | None = None
    v1: bool = False
    reopen_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.model_id is not None and not self.model_id:
            raise ValueError("model_id must be a non-empty string")
        if self.reopen_interval_s < 0:
            raise ValueError("reopen_interval_s must be >= 0")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> SGLangSettings:
        extra = dict(extra or {})
        legacy = [k for k in LEGACY_KEYS if k in extra]
        if legacy:
            raise ValueError(f"put kvcentric's SGLang options {legacy} under "
                             f"\"{SECTION}\": {{...}} in --hicache-storage-backend-extra-"
                             "config (SGLang ignores unknown top-level keys, so a typo there "
                             "would go unnoticed)")
        own = extra.get(SECTION, {})
        if not isinstance(own, Mapping):
            raise ValueError(f"\"{SECTION}\" must be an object of kvcentric options, got "
                             f"{type(own).__name__}")
        if "v1" in own:
            raise ValueError("set \"interface_v1\" at the top level (SGLang's own key), "
                             "not under \"kvcentric\"")
        kw = parse_fields(cls, own, "kvcentric SGLang options")
        kw["store"] = StoreConfig.from_dict(kw.get("store"))
        kw["v1"] = parse_bool(extra.get("interface_v1", 0) or 0, "interface_v1")
        return cls(**kw)
