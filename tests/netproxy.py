"""A TCP relay on loopback in front of a server (the tests' moto): it adds latency to every
request and can be stopped and started again on the same port, so a client sees a store that is
far away, or one that goes down and comes back, while the server keeps its objects."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Relay:
    """Forwards connections from `port` (a free one by default) to `target_port` on 127.0.0.1.

    Every chunk a client sends is held `latency` seconds before it goes on: an HTTP request (its
    headers are one chunk) is answered `latency` later, as over a link with that round trip.
    `stop()` closes the listening socket and every open connection (clients see refused and reset
    connections); `start()` listens again on the same port."""

    def __init__(self, target_port: int, latency: float = 0.0, port: int = 0) -> None:
        self.target_port, self.latency, self.port = target_port, latency, port
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Relay:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._open.update((client, server))
            threading.Thread(target=self._pump, args=(client, server, self.latency), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, 0.0), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, delay: float) -> None:
        try:
            while chunk := source.recv(1 << 16):
                if delay:
                    time.sleep(delay)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for conn in (source, sink):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open.discard(source)
                self._open.discard(sink)
            source.close()
