"""A loopback TCP proxy that counts round trips, for tests that pin them down.

A round trip is one burst of bytes from the client that the server then answers: the
proxy counts each time client data arrives after the last traffic went the other way
(or first on a connection). Pipelined commands sent in one burst count once, which is the
point: that is one network wait for the client.

    with CountingProxy("127.0.0.1", 5432) as proxy:
        connect to ("127.0.0.1", proxy.port) ...
        proxy.reset(); do_something(); assert proxy.round_trips == 1

It can also lose a reply: ``drop_next_reply()`` lets the next request reach the server
and run, then cuts the connection before the answer gets back, as a network failure would
(the client cannot know whether its command ran).

``refuse()`` makes the server unreachable, as an outage does: every connection is cut and
new ones are closed at once, until ``accept()``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable


class CountingProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._round_trips = 0
        self._replied = 0
        self._last_activity = time.monotonic()
        self._closing = threading.Event()
        self._connections: list[socket.socket] = []
        self._to_drop = 0
        self._then: list[Callable[[], object]] = []
        self._refusing = False
        #: Replies lost so far by ``drop_next_reply``.
        self.dropped = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def round_trips(self) -> int:
        """Round trips since the last ``reset``, once the traffic has gone quiet."""
        self.settle()
        with self._lock:
            return self._round_trips

    @property
    def replied_bytes(self) -> int:
        """Bytes the server sent back since the last ``reset``, once the traffic has gone
        quiet."""
        self.settle()
        with self._lock:
            return self._replied

    def reset(self) -> None:
        self.settle()
        with self._lock:
            self._round_trips = 0
            self._replied = 0

    def settle(self, quiet: float = 0.05) -> None:
        """Wait until no byte has moved for ``quiet`` seconds (replies still in flight)."""
        while True:
            with self._lock:
                idle = time.monotonic() - self._last_activity
            if idle >= quiet:
                return
            time.sleep(quiet - idle)

    def drop_next_reply(self, then: Callable[[], object] | None = None) -> None:
        """Lose the server's next reply, cutting its connection; ``then``, if given, is
        called first, while the client still waits for that reply."""
        with self._lock:
            self._to_drop += 1
            if then is not None:
                self._then.append(then)

    def refuse(self) -> None:
        """Cut every connection and refuse new ones until ``accept()``."""
        with self._lock:
            self._refusing = True
        self.kill_connections()

    def accept(self) -> None:
        """Let connections through again."""
        with self._lock:
            self._refusing = False

    def kill_connections(self) -> None:
        """Cut every proxied connection at once, as a network failure would."""
        with self._lock:
            connections, self._connections = self._connections, []
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        self.kill_connections()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
            if refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._connections += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        last_from_client = False
        peers = {client: server, server: client}
        by_fd = {client.fileno(): client, server.fileno(): server}
        poller = select.poll()  # not select(): a test process's descriptors pass 1023
        try:
            for fd in by_fd:  # -1, a ValueError, if cut before this thread began
                poller.register(fd, select.POLLIN)
            while not self._closing.is_set():
                for fd, _ in poller.poll(500):
                    sock = by_fd[fd]
                    data = sock.recv(65536)
                    if not data:
                        return
                    with self._lock:
                        self._last_activity = time.monotonic()
                        if sock is client and not last_from_client:
                            self._round_trips += 1
                        if sock is server:
                            self._replied += len(data)
                        dropping = sock is server and self._to_drop > 0
                        if dropping:
                            self._to_drop -= 1
                            self.dropped += 1
                            then = self._then.pop(0) if self._then else None
                    if dropping:
                        if then is not None:
                            then()
                        return  # the reply dies with the connection, cut below
                    last_from_client = sock is client
                    peers[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for sock in (client, server):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
