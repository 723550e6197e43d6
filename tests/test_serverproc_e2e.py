"""The test harness's server process: a port another process took first costs a restart, not a hang."""

from __future__ import annotations

import socket

import pytest
import requests

from sgl_kvevict.serve.serverproc import PortTaken, Server, free_port

from .helpers import CHECKED_ENV, POOL, START_TIMEOUT


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_free_ports_avoid_the_ephemeral_range_and_sglangs_own() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(30000 <= p < ephemeral_low for p in ports), ports


@pytest.mark.server
@pytest.mark.long
def test_a_taken_port_is_retried_on_a_fresh_one() -> None:
    srv = Server(POOL, env=CHECKED_ENV, timeout=START_TIMEOUT)
    taken = srv.port
    with _hold(taken):
        srv.start()
        try:
            assert srv.port != taken
            r = requests.post(
                srv.url + "/generate",
                json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
                timeout=120,
            )
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
        finally:
            srv.stop()


def test_a_port_named_by_the_caller_fails_fast_when_taken() -> None:
    port = free_port()
    with _hold(port):
        srv = Server(POOL, port=port, env=CHECKED_ENV, timeout=START_TIMEOUT)
        with pytest.raises(PortTaken, match=str(port)):
            srv.start()
        assert srv.proc is None
