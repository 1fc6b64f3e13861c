"""The fault-injecting TCP proxy itself, against a loopback echo server: each fault does what it says."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pdserve.faults import FaultProxy
from tests.helpers import wait_until


@pytest.fixture
def echo() -> Iterator[str]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
            conn.sendall(b"<eof>")  # tells the client the server read EOF
        except OSError:  # the proxy reset the connection
            return


def _connect(proxy: FaultProxy) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(1 << 16)
    return got


def test_delay_and_throttle_slow_the_path_down(echo: str) -> None:
    proxy = FaultProxy(echo)
    try:
        with _connect(proxy) as sock:
            started = time.monotonic()
            assert _roundtrip(sock, b"x" * 100) == b"x" * 100
            fast = time.monotonic() - started
            proxy.delay_s = 0.5
            started = time.monotonic()
            assert _roundtrip(sock, b"y") == b"y"
            # once each way; an undelayed loopback round trip takes under a millisecond, and 1 s even on a busy core
            assert time.monotonic() - started >= 1.0 > fast
            proxy.restore()
            proxy.throttle_bps = 20_000
            started = time.monotonic()
            assert _roundtrip(sock, b"z" * 5_000) == b"z" * 5_000
            assert time.monotonic() - started >= 0.4  # 5 kB each way at 20 kB/s
    finally:
        proxy.close()


def test_blackhole_holds_bytes_until_restored(echo: str) -> None:
    proxy = FaultProxy(echo)
    try:
        with _connect(proxy) as sock:
            proxy.blackhole()
            sock.sendall(b"ping")
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(16)
            proxy.restore()
            sock.settimeout(5)
            assert sock.recv(16) == b"ping"
    finally:
        proxy.close()


def test_reset_breaks_live_connections_and_half_close_ends_one_direction(echo: str) -> None:
    proxy = FaultProxy(echo)
    try:
        with _connect(proxy) as sock:
            assert _roundtrip(sock, b"a") == b"a"
            proxy.reset()
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                for _ in range(50):
                    sock.sendall(b"b")
                    if not sock.recv(16):
                        raise ConnectionResetError
                    time.sleep(0.01)
        with _connect(proxy) as sock:  # a new connection works again
            assert _roundtrip(sock, b"c") == b"c"
            proxy.half_close()
            assert sock.recv(16) == b"<eof>"  # the server read EOF and said so; the other direction still flows
    finally:
        proxy.close()


def test_scheduled_faults_fire_at_their_time(echo: str) -> None:
    proxy = FaultProxy(echo)
    try:
        fired: list[tuple[float, bool]] = []  # (seconds after scheduling, the path open then)
        started = time.monotonic()
        proxy.at([(0.2, lambda: fired.append((time.monotonic() - started, proxy._open.is_set()))),
                  (0.1, proxy.blackhole)])
        wait_until(lambda: fired, "the fault scheduled at 0.2 s")
        # in time order, whatever the list's: the blackhole at 0.1 s came first; neither early
        assert len(fired) == 1 and fired[0][0] > 0.18 and fired[0][1] is False
    finally:
        proxy.close()
