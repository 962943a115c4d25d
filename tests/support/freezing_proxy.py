"""``FreezingProxy``: a loopback TCP proxy that stops forwarding on demand and never passes
a side's end on, for tests of partitions and of sessions whose socket outlives them."""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
import threading
import time


class FreezingProxy:
    """A loopback TCP proxy that can stop forwarding while keeping every socket open: a
    partition that drops packets (no reset, no closed socket), for one client only. The end
    of one side is not passed on either: the other side's socket stays open until
    ``close()``, as a peer whose close is slow to arrive."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.sockets: list[socket.socket] = []
        self.mutex = threading.Lock()
        self.closed = False
        #: The last bytes each server connection sent before it ended, in order of the ends
        #: (passed on to the client, whose socket stays open).
        self.last_words: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                return
            for end in (client, server):  # as a server does: no byte waits for an ACK
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.mutex:  # a connection accepted as the proxy closes is closed too
                late = self.closed
                if not late:
                    self.sockets += [client, server]
            if late:
                client.close()
                server.close()
                return
            for a, b, told in ((client, server, None), (server, client, self.last_words)):
                threading.Thread(target=self._pump, args=(a, b, told), daemon=True).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, told: list[bytes] | None = None
    ) -> None:
        last = b""
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    break
                self.flowing.wait()
                sink.sendall(data)
                last = data
            except OSError:
                return
        if told is not None:
            _delivered(sink)
            with self.mutex:
                told.append(last)

    def ended_saying(self, words: bytes) -> bool:
        """Whether a server connection ended, its last bytes (holding ``words``) passed on."""
        with self.mutex:
            return any(words in last for last in self.last_words)

    def close(self) -> None:
        self.flowing.set()
        self.listener.close()
        with self.mutex:
            self.closed = True
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def _delivered(sock: socket.socket, within: float = 10.0) -> None:
    """Wait until the peer of ``sock`` has acknowledged every byte sent to it (Linux's
    ``SIOCOUTQ``, bytes sent and not yet acknowledged: none left means they are in the
    peer's receive queue), or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
        except (OSError, ValueError):  # closed meanwhile (the proxy's close)
            return
        if struct.unpack("i", queued)[0] == 0:
            return
        time.sleep(0.002)
