"""``kvcentric doctor``: each diagnosis caught on a real misconfiguration (an old vLLM
shadowing the installed one, kvcentric importable but not installed, a store that is not
running, a store larger than its /dev/shm, a dead or empty Mooncake master, rdma without
NICs), with the healthy case next to each; those that need a real engine (layouts, an
engine writing elsewhere, router configs against engines) are in
tests/test_doctor_engine.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcentric import doctor
from kvcentric.config import StoreConfig
from kvcentric.doctor import DoctorInputs, engines, router_checks, stores
from kvcentric.doctor.diagnose import ENGINES
from kvcentric.store import StoreUnavailable, open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.config import socket_path
from kvcentric.store.mooncake.config import MooncakeSettings
from kvcentric.testing.servers import free_port, stop_group

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict[str, str] | None = None, pyflags: tuple[str, ...] = (),
        cwd: Path = ROOT) -> tuple[int, dict[str, Any]]:
    """``kvcentric doctor ARGS --json`` in a fresh interpreter: (exit code, findings)."""
    out = subprocess.run([sys.executable, *pyflags, "-m", "kvcentric.cli", "doctor", *args,
                          "--json"], capture_output=True, text=True, timeout=300,
                         env=env, cwd=cwd)
    try:
        body = json.loads(out.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(out.stdout + out.stderr) from exc
    return out.returncode, {f["check"]: f for f in body["findings"]}


# ---- installed engines and the plugin ----
def test_old_vllm_shadowing_the_installed_one(tmp_path: Path) -> None:
    """A stale vLLM on PYTHONPATH (0.6.3, before the v1 KV connector API) wins the import."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('__version__ = "0.6.3"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    rc, found = cli("--engine", "vllm", env=env)  # SGLang's import is not the claim
    assert rc == 1 and "sglang-version" not in found
    f = found["vllm-version"]
    assert f["status"] == "fail" and "0.6.3" in f["message"] and str(tmp_path) in f["message"]
    assert "0.32.0" in f["fix"]
    assert engines.check_vllm_version().status == "ok"  # the real install, for contrast


def test_the_engines_are_inspected_at_the_same_time(tmp_path: Path) -> None:
    """Each engine's import runs in a probe of its own, and the two overlap (the doctor
    waits for the slower, not for the sum). Mounted with stand-in engines on PYTHONPATH
    whose import waits until the other one's has begun: run one after the other, each
    would wait out its deadline and say so."""
    for name, other in (("vllm", "sglang"), ("sglang", "vllm")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            "import os, pathlib, time\n"
            f"d = pathlib.Path({str(tmp_path)!r})\n"
            f"(d / '{name}.started').touch()\n"
            "deadline = time.monotonic() + 60\n"
            f"while not (d / '{other}.started').exists() and time.monotonic() < deadline:\n"
            "    time.sleep(0.05)\n"
            f"if not (d / '{other}.started').exists():\n"
            f"    (d / '{name}.alone').touch()\n"
            '__version__ = "0.6.3"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    rc, found = cli(env=env)
    assert rc == 1 and "0.6.3" in found["vllm-version"]["message"]
    assert (tmp_path / "vllm.started").exists() and (tmp_path / "sglang.started").exists()
    assert not list(tmp_path.glob("*.alone")), "the probes ran one after the other"


def test_plugin_missing_when_kvcentric_is_not_installed(tmp_path: Path) -> None:
    """Run from a source checkout without `pip install`: kvcentric imports, but no
    vllm.general_plugins entry point exists, so vLLM never learns KVCentricConnector."""
    site = Path(sysconfig.get_paths()["purelib"])
    fake, src = tmp_path / "site", tmp_path / "src"
    fake.mkdir()
    src.mkdir()
    for entry in site.iterdir():
        if "kvcentric" not in entry.name and not entry.name.endswith(".pth"):
            (fake / entry.name).symlink_to(entry)
    (src / "kvcentric").symlink_to(ROOT / "kvcentric")  # the package, not its metadata
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(fake)])}
    rc, found = cli("--engine", "vllm", env=env, pyflags=("-S",), cwd=tmp_path)
    assert rc == 1
    f = found["connector-plugin"]
    assert f["status"] == "fail" and "not installed" in f["message"]
    assert "kv_connector_module_path" in f["fix"]
    assert engines.check_plugin().status == "ok"


def test_engine_selects_what_is_inspected(tmp_path: Path) -> None:
    """``--engine sglang`` inspects SGLang only (no vLLM probe, no plugin check); an
    engine that is not installed is a warning naming it; ``--engine`` with
    ``--skip-engines`` and an unknown engine are refused."""
    (tmp_path / "vllm").mkdir()  # a vLLM whose import would fail the run if probed
    (tmp_path / "vllm" / "__init__.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("raise ImportError('gone')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    rc, found = cli("--engine", "sglang", env=env)
    assert set(found) == {"sglang-version", "engines"}, found
    assert found["sglang-version"]["status"] == "skip"
    assert found["engines"]["status"] == "warn"
    assert found["engines"]["message"] == "SGLang is not installed here"
    both = subprocess.run([sys.executable, "-m", "kvcentric.cli", "doctor", "--engine", "vllm",
                           "--skip-engines"], capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "exclude each other" in both.stderr
    bad = subprocess.run([sys.executable, "-m", "kvcentric.cli", "doctor", "--engine", "trt"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    with pytest.raises(ValueError, match="trt"):
        DoctorInputs(engines=("trt",))
    from kvcentric.cli import build_parser
    args = build_parser().parse_args(["doctor", *(f"--engine={e}" for e in ENGINES)])
    assert tuple(args.engine) == ENGINES  # the CLI's choices are the engines it knows


def test_plugin_excluded_by_vllm_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolvers")
    f = engines.check_plugin()
    assert f.status == "fail" and "VLLM_PLUGINS" in f.message


def test_decode_instances_are_not_probed(tmp_path: Path, store_cfg: StoreConfig) -> None:
    """A kv_consumer never saves, so a missing probe block would be a false alarm."""
    url = f"http://127.0.0.1:{free_port()}"
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "tokenizer": str(tmp_path), "store": {
        "name": store_cfg.name, "runtime_dir": str(store_cfg.local.runtime_dir)},
        "instances": [{"url": url, "role": "decode"}]}))
    found = {f.check: f for f in doctor.run(doctor.DoctorInputs(None, str(path), url,
                                                                engines=()))}
    assert found["layout-signature"].status == "skip"
    assert found["router-instance"].status == "fail"  # and nothing answers there


def _files(cfg_path: Path) -> dict[str, Any]:
    cfg, loaded = router_checks.load_router(str(cfg_path))
    assert loaded.status == "ok", loaded
    return {f.check: f for f in router_checks.check_router_files(cfg)}


def test_router_files_the_router_would_reject(tmp_path: Path, tiny_dir: str) -> None:
    """The doctor reads the tokenizer folder, its config.json and cost.profile as the
    router does at start, and fails exactly where the router would refuse to start."""
    from kvcentric.router.api.app import build_state
    from kvcentric.router.config import load_config

    no_config = tmp_path / "tok"  # a tokenizer without the model's config.json
    no_config.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_dir) / name, no_config / name)
    (tmp_path / "bad.json").write_text("{")
    cases = {
        "missing": ({"tokenizer": str(tmp_path / "nope")}, "router-tokenizer", "not exist"),
        "hub id": ({"tokenizer": "Qwen/Qwen3-0.6B"}, "router-tokenizer", "hub id"),
        "no config.json": ({"tokenizer": str(no_config)}, "router-model-config",
                           "config.json"),
        "bad profile": ({"tokenizer": tiny_dir, "cost": {"profile": str(tmp_path / "bad.json")}},
                        "router-profile", "bad.json"),
    }
    for name, (over, check, needle) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"model": "tiny", **over}))
        f = _files(path)[check]
        assert f.status == "fail" and needle in f.message and f.fix, (name, f)
        with pytest.raises(ValueError):  # the router refuses the same config
            build_state(load_config(path))


def test_router_init_config_passes_the_file_checks(tmp_path: Path, tiny_dir: str) -> None:
    from kvcentric.router.cli import main as router_main
    from kvcentric.router.config import load_config

    path = tmp_path / "router.yaml"
    assert router_main(["init", str(path), "--model", "tiny", "--tokenizer", tiny_dir,
                        "--instance", "http://127.0.0.1:8101", "--port", "8123"]) == 0
    cfg = load_config(path)
    assert (cfg.model, cfg.tokenizer, cfg.listen.port) == ("tiny", tiny_dir, 8123)
    assert [i.url for i in cfg.instances] == ["http://127.0.0.1:8101"] and cfg.store is None
    found = _files(path)
    assert {k: f.status for k, f in found.items()} == {"router-tokenizer": "ok",
                                                       "router-model-config": "ok"}
    assert router_main(["init", str(path)]) == 2  # never overwrites without --force


def test_engine_url_that_is_not_an_engine() -> None:
    f = engines.check_engine_url_version(f"http://127.0.0.1:{free_port()}")
    assert f.status == "fail" and "/version" in f.message


# ---- the local store ----
def test_store_not_running(runtime_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command itself, in this process, with ``--skip-engines``: the store's findings
    and no engine or plugin check (those import vLLM and SGLang; the tests above)."""
    from kvcentric.cli import main

    cfg = StoreConfig.from_dict({"name": f"absent{uuid.uuid4().hex[:6]}",
                                 "runtime_dir": runtime_dir})
    capsys.readouterr()
    rc = main(["doctor", "--store", json.dumps({"name": cfg.name,
                                                "runtime_dir": str(runtime_dir)}),
               "--skip-engines", "--json"])
    found = {f["check"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert not {"vllm-version", "sglang-version", "engines", "connector-plugin"} & set(found)
    assert rc == 1 and found["store-reachable"]["status"] == "fail"
    assert not socket_path(cfg).exists(), "the doctor must not start a coordinator"


def test_store_running(store_cfg: StoreConfig) -> None:
    open_store(store_cfg).close()  # starts its coordinator
    reach, stats = stores.check_local_store(store_cfg)
    assert reach.status == "ok" and stats is not None
    assert stores.check_shm(store_cfg, stats).status == "ok"


def test_store_larger_than_its_shm(runtime_dir: Path) -> None:
    """A coordinator cannot reserve an arena larger than its tmpfs: it refuses to start,
    and the doctor says why from the config alone."""
    st = os.statvfs(runtime_dir)
    size = st.f_blocks * st.f_frsize
    cfg = StoreConfig.from_dict({"name": f"big{uuid.uuid4().hex[:6]}",
                                 "capacity_bytes": size + (1 << 30), "runtime_dir": runtime_dir,
                                 "prefault": False})
    with pytest.raises(StoreUnavailable, match="cannot reserve"):
        open_store(cfg)
    assert not launcher.is_running(cfg)
    f = stores.check_shm(cfg, None)
    assert f.status == "fail" and "exceeds" in f.message and "sizeLimit" in f.fix


# ---- Mooncake ----
def test_mooncake_master_unreachable() -> None:
    s = MooncakeSettings.load({"master_server_address": f"127.0.0.1:{free_port()}",
                               "use_env": False})
    f = stores.check_mooncake_master(s)
    assert f.status == "fail" and "does not accept" in f.message


@pytest.mark.mooncake
def test_mooncake_master_without_storage_nodes(mooncake_ns: Any, tmp_path: Path) -> None:
    """A master nobody lends memory to: every put fails for lack of space."""
    from kvcentric.store.mooncake.service import master_command, wait_master

    cmd = master_command("127.0.0.1", 50251, 9203, 0)
    proc = subprocess.Popen(mooncake_ns.wrap(cmd), stdout=open(tmp_path / "m.log", "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with mooncake_ns.entered():
            wait_master("127.0.0.1", 50251, 9203, proc=proc)
            s = MooncakeSettings.load({"master_server_address": "127.0.0.1:50251",
                                       "metrics_url": "http://127.0.0.1:9203/metrics",
                                       "use_env": False})
            f = stores.check_mooncake_master(s)
    finally:
        stop_group(proc, 10)
    assert f.status == "warn" and "no memory" in f.message and "mooncake-node" in f.fix


def test_rdma_without_nics() -> None:
    from kvcentric.store.mooncake.rdma import list_devices

    if any(d.active_ports for d in list_devices()[0]):
        pytest.skip("this machine has an active RDMA NIC")
    f = stores.check_transport(MooncakeSettings.load({"protocol": "rdma", "use_env": False}))
    assert f.status == "fail" and "RDMA" in f.message
    f = stores.check_transport(MooncakeSettings.load({"protocol": "rdma", "use_env": False,
                                                      "fallback_to_tcp": True}))
    assert f.status == "warn" and "falling back" in f.message
    assert stores.check_transport(MooncakeSettings.load({"use_env": False})).status == "ok"
