"""kvcentric.testing.servers.free_port: ports no port-0 bind or outgoing connection takes."""

from __future__ import annotations

import socket

import pytest

from kvcentric.testing import servers


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = servers._ephemeral_low()
    ports = [servers.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(servers.LOWEST_PORT <= p < low for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: a server can take it


def test_the_scan_skips_a_taken_port_and_one_already_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        taken = servers.free_port()
        held.bind(("127.0.0.1", taken))
        monkeypatch.setattr(servers.random, "randrange", lambda a, b: taken)
        first = servers.free_port()  # the scan starts at the bound port and moves on
        second = servers.free_port()  # from the same start: skips the port already given
        assert first != taken and second not in (taken, first)
