"""The soak's engines get tcmalloc preloaded (vLLM CPU's recommended allocator)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcentric.testing import servers


def test_preloads_an_existing_library_before_what_was_there(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(servers, "TCMALLOC_DIRS", (str(tmp_path / "absent"), str(tmp_path)))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert servers.tcmalloc_env() == {"LD_PRELOAD": str(lib)}
    monkeypatch.setenv("LD_PRELOAD", "/x/libother.so")
    assert servers.tcmalloc_env() == {"LD_PRELOAD": f"{lib}:/x/libother.so"}


def test_missing_library_names_the_package(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setattr(servers, "TCMALLOC_DIRS", (str(tmp_path),))
    with pytest.raises(FileNotFoundError, match="libtcmalloc-minimal4"):
        servers.tcmalloc_env()
