"""A real S3 API on loopback for the tests and the benchmarks: a moto server in a process of its
own, the requests it received (`requests_made`), and a TCP relay in front of it that adds latency
to every request and can be stopped and started again on the same port, so a client sees a store
that is far away, or one that goes down and comes back, while the server keeps its objects."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def start_moto(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """A moto S3 server on 127.0.0.1:`port`, recording requests (see `requests_made`), logging
    to `workdir`/server.log; returns once it accepts connections."""
    log = workdir / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=out,
            env={**os.environ, "MOTO_RECORDER_FILEPATH": str(workdir / "recording")},
        )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"moto server did not start: {log.read_text()}") from None
            time.sleep(0.1)


@contextlib.contextmanager
def s3_environment(**variables: str) -> Iterator[None]:
    """Test credentials and a region (and any other `variables`) in os.environ for the block;
    what was there before is put back after it."""
    wanted = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    wanted.update(variables)
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def requests_made(endpoint: str) -> Iterator[list[dict[str, Any]]]:
    """The requests the S3 server received inside the block, as it recorded them."""

    def call(action: str) -> bytes:
        method = "GET" if action == "download-recording" else "POST"
        request = urllib.request.Request(f"{endpoint}/moto-api/recorder/{action}", method=method, data=None)
        with urllib.request.urlopen(request, timeout=30) as response:
            return bytes(response.read())

    made: list[dict[str, Any]] = []
    call("reset-recording")
    call("start-recording")
    try:
        yield made
    finally:
        call("stop-recording")
        made += [json.loads(line) for line in call("download-recording").decode().splitlines() if line.strip()]


def data_gets(made: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GETs of shard objects (chunks and indexes), not of metadata documents."""
    return [r for r in made if r["method"] == "GET" and "/c/" in r["url"]]


def range_bytes(request: dict[str, Any]) -> int | None:
    """The bytes a ranged GET asked for (None for a whole object)."""
    spec = request["headers"].get("Range") or request["headers"].get("range")
    if spec is None:
        return None
    first, _, last = spec.removeprefix("bytes=").partition("-")
    return int(last) - int(first) + 1 if first else int(last)


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
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, delayed: bool) -> None:
        try:
            while chunk := source.recv(1 << 16):
                if delayed and self.latency:  # read each time: a change reaches open connections too
                    time.sleep(self.latency)
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


def start_relay(target_port: int, latency: float) -> tuple[subprocess.Popen[str], str]:
    """A `Relay` in a process of its own (its copying does not take turns with the reader's
    threads for one interpreter lock); returns it and its endpoint."""
    relay = subprocess.Popen(
        [sys.executable, __file__, str(target_port), str(latency)], stdout=subprocess.PIPE, text=True
    )
    assert relay.stdout is not None
    return relay, relay.stdout.readline().strip()


if __name__ == "__main__":
    running = Relay(int(sys.argv[1]), float(sys.argv[2])).start()
    print(running.endpoint, flush=True)
    threading.Event().wait()
