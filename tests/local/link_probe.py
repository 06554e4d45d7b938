"""Run inside an island's namespace by tests/local/test_netns.py: measures the link to an echo server through
the hub, and prints JSON: the shortest of a few one-byte round trips, and how long `bytes` took to go there and
back (both directions of the link at once)."""

import json
import socket
import sys
import threading
import time


def main(host: str, port: int, size: int) -> None:
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        round_trips = []
        for _ in range(5):
            started = time.perf_counter()
            sock.sendall(b"x")
            sock.recv(1)
            round_trips.append(time.perf_counter() - started)
        started = time.perf_counter()
        sender = threading.Thread(target=sock.sendall, args=(b"y" * size,))
        sender.start()
        received = 0
        while received < size:
            received += len(sock.recv(1 << 16))
        sender.join()
        print(json.dumps({"rtt_seconds": min(round_trips), "echo_seconds": time.perf_counter() - started}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
