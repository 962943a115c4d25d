"""A private ``redis-server`` for the tests that need a Redis of their own (restarts, a
unix socket, TLS, a replica): on a free port and a unix socket in a directory of its own,
without persistence unless told; the shared server on 6379 is never touched. A missing
``redis-server`` is a skip (a failure under ``DLOCK_REQUIRE_ALL=1``)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support import eventually, unavailable

__all__ = ["RedisServer", "private_redis"]


class RedisServer:
    """A private ``redis-server`` without persistence, on a free port and a unix socket."""

    def __init__(self, directory: Path, *extra: str) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            unavailable("redis-server is not installed (apt-get install redis-server)")
        self.executable = executable
        self.directory = directory
        self.socket = str(directory / "redis.sock")
        self.extra = extra
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port: int = sock.getsockname()[1]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def args(self) -> list[str]:
        return [
            self.executable,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--unixsocket", self.socket,
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            *self.extra,
        ]  # fmt: skip

    def url(self, prefix: str, **options: object) -> str:
        # A fresh server quarantines first clients for restart_delay (it may have just lost
        # its data): tests not about that quarantine turn it off.
        options = {"prefix": prefix, "restart_delay": 0, **options}
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"redis://127.0.0.1:{self.port}/0?{query}"

    def client(self) -> Any:
        import redis

        return redis.Redis(unix_socket_path=self.socket)

    def start(self) -> None:
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - the server keeps it
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        client = self.client()
        try:
            eventually(lambda: self._ping(client), "redis-server starts", timeout=20)
        finally:
            client.close()

    def _ping(self, client: Any) -> bool | None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(
                f"redis-server exited: {(self.directory / 'redis.log').read_text()}"
            )
        import redis

        with contextlib.suppress(redis.RedisError):
            return bool(client.ping())
        return None

    def stop(self) -> None:
        """Stop it as a crash would: SIGKILL, nothing saved (there is no persistence)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def private_redis(prefix: str = "dlock-redis-", *extra: str) -> Iterator[RedisServer]:
    """A started :class:`RedisServer` (``extra``: more of its arguments) in a temporary
    directory named ``prefix...``, stopped and removed at the end."""
    # A short path: unix socket paths are limited to ~107 bytes.
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    private = RedisServer(directory, *extra)
    try:
        private.start()
        yield private
    finally:
        private.stop()
        shutil.rmtree(directory, ignore_errors=True)
