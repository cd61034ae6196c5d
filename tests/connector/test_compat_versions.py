"""The static check of a newer vLLM wheel (benchmarks/compat/vllm_versions.py), on a wheel
made here: a hook that disappears or changes its signature is a problem, a new hook is
listed, and the installed vLLM's own base class passes against itself."""

from __future__ import annotations

import zipfile
from pathlib import Path

import vllm

from benchmarks.compat.vllm_versions import BASE, api_of, static_check

INSTALLED = Path(vllm.__file__).parent / "distributed/kv_transfer/kv_connector/v1/base.py"


def wheel(tmp: Path, source: str,
          config: str = "kv_load_failure_policy kv_connector_extra_config") -> Path:
    path = tmp / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(BASE, source)
        z.writestr("vllm/config/kv_transfer.py", config)
    return path


def test_the_installed_api_passes_and_changes_are_problems(tmp_path: Path) -> None:
    src = INSTALLED.read_text()
    same = static_check(wheel(tmp_path, src))
    assert same["ok"] and same["added_hooks"] == {} and "start_load_kv" in same["hooks_checked"]
    assert set(api_of(src)) == {"KVConnectorBase_V1", "SupportsHMA"}
    changed = src.replace("def wait_for_layer_load(self, layer_name: str)",
                          "def wait_for_layer_load(self, layer_name: str, stream)")
    changed = changed.replace("def save_kv_layer(", "def save_kv_layer_renamed(")
    changed = changed.replace("    def wait_for_save(self):",
                              "    def new_hook(self, x) -> None:\n        return\n\n"
                              "    def wait_for_save(self):")
    out = static_check(wheel(tmp_path, changed, config="nothing"))
    assert not out["ok"]
    assert ("wait_for_layer_load: @abstractmethod (self, layer_name) -> @abstractmethod "
            "(self, layer_name, stream)") in out["problems"]
    assert "save_kv_layer: missing in the wheel" in out["problems"]
    assert "vllm/config/kv_transfer.py: no kv_load_failure_policy" in out["problems"]
    assert set(out["added_hooks"]) == {"new_hook", "save_kv_layer_renamed"}
    assert out["added_hooks"]["new_hook"].endswith("(self, x)")
