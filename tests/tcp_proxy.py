"""A loopback TCP proxy for network fault injection (this machine has no tc netem).

Forwards every connection to a target. `stall_after` bytes into the client -> server direction it stops
reading from the client, as a frozen network path would: the server sees a stream that simply stops.
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, target: str, stall_after: int | None = None) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.stall_after = stall_after
        self.forwarded = 0  # client -> server bytes, over all connections
        self.stalled = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [client, server]
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
                data = source.recv(budget)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)
                if upstream:
                    with self._lock:
                        self.forwarded += len(data)
        except OSError:
            return

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.close()
                except OSError:
                    pass
