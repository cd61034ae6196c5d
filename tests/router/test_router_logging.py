"""The router's log at its default level (info) is not flooded by its own health polls
(several a second per engine); at debug it logs every upstream request."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.lib.paths import module_command
from kvcentric.testing.servers import free_port, spawn, stop_group, wait_http
from tests.helpers.waiting import wait_until


@pytest.mark.parametrize("level,polls_logged", [("info", False), ("debug", True)])
def test_health_polls_stay_out_of_the_info_log(tiny_dir: str, tmp_path: Path, level: str,
                                               polls_logged: bool) -> None:
    eport, rport = free_port(), free_port()
    cfg = {"model": "tiny", "tokenizer": tiny_dir, "listen": {"port": rport},
           "log_level": level, "health": {"interval_s": 0.1, "metrics_interval_s": 0.1},
           "instances": [{"url": f"http://127.0.0.1:{eport}", "role": "both", "name": "e0"}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))
    stub = router = None
    try:
        stub = spawn(module_command("benchmarks.lib.stub_engine", "--ports", str(eport),
                                    "--tokenizer", tiny_dir), tmp_path / "stub.log")
        wait_http(f"http://127.0.0.1:{eport}/health", stub, tmp_path / "stub.log")
        router = spawn([sys.executable, "-m", "kvcentric.router.cli", "serve", "--config",
                        str(tmp_path / "r.yaml")], tmp_path / "router.log")
        url = f"http://127.0.0.1:{rport}"
        wait_http(url + "/health", router, tmp_path / "router.log")
        # positive evidence that the router polled: the stub counts the /metrics reads
        # (its counters grow with them; our own reads are counted and taken off)
        own = 0

        def polled() -> int:
            nonlocal own
            own += 1
            page = httpx.get(f"http://127.0.0.1:{eport}/metrics", timeout=5).text
            n = next(float(ln.split()[-1]) for ln in page.splitlines()
                     if ln.startswith("vllm:prompt_tokens_total"))
            return int(n) // 97 - own

        assert wait_until(lambda: polled() >= 10, 60)  # ~10 polls of /metrics, more of /health
        inst = httpx.get(url + "/instances", timeout=5).json()["instances"]
        assert inst and all(i["healthy"] for i in inst)
    finally:
        stop_group(router)
        stop_group(stub)
    text = (tmp_path / "router.log").read_text()
    assert (f"upstream GET http://127.0.0.1:{eport}/health: HTTP 200" in text) is polls_logged, \
        text[-2000:]
