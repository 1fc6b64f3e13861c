"""A loopback TCP proxy that injects network faults (this machine has no tc netem), for tests and `bench chaos`.

It forwards every connection to a target. Faults can be switched on and off while traffic flows, or on a
schedule (`at`):
- `delay_s`: every forwarded piece waits this long;
- `throttle_bps`: at most this many bytes per second per direction of each connection;
- `blackhole()` / `restore()`: stop forwarding in both directions, connections left open, as a dead path would;
- `reset()`: close every live connection abruptly (TCP RST);
- `half_close()`: end the client -> server direction of every live connection (the server reads EOF);
- `stall_after`: after this many client -> server bytes in all, stop reading from clients (a frozen path).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable


class FaultProxy:
    def __init__(self, target: str, stall_after: int | None = None) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.stall_after = stall_after
        self.delay_s = 0.0
        self.throttle_bps = 0.0  # 0: unlimited
        self.forwarded = 0  # client -> server bytes, over all connections
        self.stalled = threading.Event()
        self._open = threading.Event()  # cleared while blackholed
        self._open.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    # Faults.
    def blackhole(self) -> None:
        self._open.clear()

    def restore(self) -> None:
        self.delay_s, self.throttle_bps = 0.0, 0.0
        self._open.set()

    def reset(self) -> None:
        for client, server in self._take_pairs():
            for sock in (client, server):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
                _close(sock)

    def half_close(self) -> None:
        with self._lock:
            pairs = list(self._pairs)
        for _, server in pairs:
            try:
                server.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def at(self, schedule: list[tuple[float, Callable[[], None]]]) -> None:
        """Run each fault `seconds` from now, in a background thread: [(seconds, proxy.reset), ...]."""
        started = time.monotonic()

        def run() -> None:
            for seconds, action in sorted(schedule, key=lambda item: item[0]):
                time.sleep(max(0.0, started + seconds - time.monotonic()))
                if self._closed:
                    return
                action()

        threading.Thread(target=run, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        _close(self._listener)
        for pair in self._take_pairs():
            for sock in pair:
                _close(sock)

    # Forwarding.
    def _take_pairs(self) -> list[tuple[socket.socket, socket.socket]]:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        return pairs

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self._target)
            except OSError:  # the target is down: so is this connection
                _close(client)
                continue
            with self._lock:
                self._pairs.append((client, server))
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while True:
                budget = 1 << 16
                if upstream and self.stall_after is not None:
                    with self._lock:
                        budget = min(budget, self.stall_after - self.forwarded)
                    if budget <= 0:
                        self.stalled.set()
                        return  # stop reading: whatever the client sends now goes nowhere
                if self.throttle_bps:
                    budget = max(1, min(budget, int(self.throttle_bps / 20)))  # ~20 sends a second at most
                data = source.recv(budget)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                self._open.wait()  # blackholed: hold the bytes (the peers see a silent path)
                if self.delay_s:
                    time.sleep(self.delay_s)
                if self.throttle_bps:
                    time.sleep(len(data) / self.throttle_bps)
                sink.sendall(data)
                if upstream:
                    with self._lock:
                        self.forwarded += len(data)
        except OSError:
            return


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
