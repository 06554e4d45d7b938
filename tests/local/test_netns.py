"""Islands behind shaped links, on real network namespaces: what an island measures through its link to a
server on the host's loopback is the configured rate and round trip, islands reach one another across the
hub, and nothing is left behind. Skipped (never failed) where namespaces cannot be made."""

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support import require_network_namespaces

from diloco.local.delay_proxy import DelayProxy
from diloco.local.netns import HUB_ADDRESS, IslandNetwork, WanUnavailable, island_address
from diloco.local.wan import TCP_SHARE, Link

pytestmark = pytest.mark.process

PROBE = Path(__file__).with_name("link_probe.py")


@pytest.fixture(scope="module", autouse=True)
def namespaces_allowed():
    require_network_namespaces()


def namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


class EchoServer:
    """Echoes every connection's bytes back, on the host's loopback."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


def test_an_island_sees_the_links_rate_and_round_trip_to_the_host():
    link = Link(mbps=2.0, rtt_ms=100.0)
    size = 400_000  # 1.6 s each way at 2 Mbit/s
    echo = EchoServer()
    before = namespaces()
    try:
        with IslandNetwork(1, link) as network:
            network.shape()
            listener = network.listen(echo.port)
            with DelayProxy({listener: ("127.0.0.1", echo.port)}, link.one_way_seconds):
                probe = network.command(0, [sys.executable, str(PROBE), HUB_ADDRESS, str(echo.port), str(size)])
                done = subprocess.run(probe, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    finally:
        echo.close()
    measured = json.loads(done.stdout)
    mbps = size * 8 / measured["echo_seconds"] / 1e6
    print(f"measured {mbps:.3f} Mbit/s, round trip {measured['rtt_seconds'] * 1000:.1f} ms")
    assert measured["rtt_seconds"] >= 0.1, "the proxy holds each direction for half the round trip"
    assert measured["rtt_seconds"] < 0.1 + 1.0, "and not much more on a quiet link"
    assert mbps <= 2.0 * 1.1, f"{mbps:.2f} Mbit/s through a 2 Mbit/s link"
    assert mbps >= 2.0 * TCP_SHARE, f"{mbps:.2f} Mbit/s: the link runs near its rate"
    assert namespaces() == before, "every namespace made is deleted"


SERVE_ONCE = "import socket, sys; c, _ = socket.create_server((sys.argv[1], 29500)).accept(); c.sendall(b'hello')"
CONNECT = """
import socket, sys, time
for _ in range(100):
    try:
        print(socket.create_connection((sys.argv[1], 29500), timeout=5).recv(5).decode())
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
"""


def test_islands_reach_one_another_across_the_hub():
    """Data-parallel's ranks meet island to island, each crossing its own link."""
    with IslandNetwork(2, Link(mbps=100.0)) as network:
        server = subprocess.Popen(network.command(0, [sys.executable, "-c", SERVE_ONCE, island_address(0)]))
        try:
            client = network.command(1, [sys.executable, "-c", CONNECT, island_address(0)])
            assert subprocess.run(client, capture_output=True, text=True, timeout=60).stdout.strip() == "hello"
        finally:
            server.kill()
            server.wait()


def test_a_network_that_fails_part_way_deletes_what_it_made(monkeypatch):
    before = namespaces()
    network = IslandNetwork(2, Link(mbps=1.0))
    network.islands[1] = network.islands[0]  # the second island's namespace cannot be made: it exists
    with pytest.raises(WanUnavailable):
        network.__enter__()
    assert namespaces() == before
