"""Real PgBouncers in front of the test PostgreSQL (Debian's ``pgbouncer``), each on a
free local port: ``pgbouncer(mode, pool_size)`` for a test of its own, ``pgbouncer_url()``
for one in transaction pooling mode shared by the whole run. A missing ``pgbouncer`` is a
skip (a failure under ``DLOCK_REQUIRE_ALL=1``)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

from tests.support import unavailable
from tests.support.services import POSTGRES_URL

#: Server connections of the shared pooler (per database and user): small, so that a test
#: with more clients than this shows the pooling.
POOL_SIZE = 4

_shared = contextlib.ExitStack()
_shared_url: list[str] = []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def pgbouncer(
    mode: str, pool_size: int = POOL_SIZE, target: str = POSTGRES_URL, **settings: str
) -> Iterator[str]:
    """A private PgBouncer in pool ``mode`` (trust auth, ``pool_size`` server connections)
    in front of the server of ``target`` (default: the test server), ``settings`` added to
    its ``[pgbouncer]`` section, stopped on exit; its ``postgresql://`` URL."""
    binary = shutil.which("pgbouncer") or shutil.which("/usr/sbin/pgbouncer")
    if binary is None:
        unavailable("pgbouncer is not installed (apt-get install pgbouncer)")
    server = conninfo_to_dict(target)
    user = server.get("user", "postgres")
    port = _free_port()
    # PgBouncer refuses to run as root, and reads its files as the user it becomes.
    folder = Path(tempfile.mkdtemp(prefix="dlock-pgbouncer-"))
    folder.chmod(0o755)
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    lines = {
        "listen_addr": "127.0.0.1",
        "listen_port": str(port),
        "auth_type": "trust",
        "auth_file": str(folder / "users.txt"),
        "pool_mode": mode,
        "default_pool_size": str(pool_size),
        "max_client_conn": "1000",
        "unix_socket_dir": "",
        # After a server restart, log in again within a second (the default waits 15 s).
        "server_login_retry": "1",
        **settings,
    }
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n{server['dbname']} = host={server.get('host', '127.0.0.1')} "
        f"port={server.get('port', 5432)} dbname={server['dbname']}\n[pgbouncer]\n"
        + "".join(f"{name} = {value}\n" for name, value in lines.items())
    )
    for path in folder.iterdir():
        path.chmod(0o644)
    as_user = ["-u", "postgres"] if os.geteuid() == 0 else []
    process = subprocess.Popen(
        [binary, *as_user, str(folder / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not start on port {port}") from None
                time.sleep(0.05)
        yield f"postgresql://{user}@127.0.0.1:{port}/{server['dbname']}"
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def pgbouncer_url() -> str:
    """The URL of the run's shared PgBouncer in transaction pooling mode (``POOL_SIZE``
    server connections), started at first use and stopped when the run ends."""
    if not _shared_url:
        _shared_url.append(_shared.enter_context(pgbouncer("transaction")))
        atexit.register(_shared.close)
    return _shared_url[0]
