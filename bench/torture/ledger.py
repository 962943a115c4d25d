"""The fenced ledger each critical section writes: a counter per key that refuses stale fences.

A section reads the key's counter with its lease's fence, works, and writes counter + 1 with
that fence. The read registers the fence first, in the same atomic step ("Paying safely" in
the README: the fence check before the read); the write is accepted only if its fence is above
the last accepted one and no higher fence has read since, and is journalled in the same
atomic step. A holder that lost its lease (paused past its ttl, cut off) and wakes up to write
after its successor read is refused even if the successor has not written yet: a fence
checked at the write alone accepts it, and the two updates overwrite each other (the first
million-acquisition file run lost one update so). The counter is read and written in two
steps on purpose: two holders in the section at once that both get a write accepted lose an
update, which the checker sees as a counter below the number of accepted writes. A read
without a fence (the soak's) registers nothing.

- ``postgresql://...#table``: the tables ``<table>`` and ``<table>_journal`` (a database that
  the store's restarts do not touch: the shared server, for a Postgres store).
- ``file:///dir``: one file per key of fixed-width lines ``fence counter``; the last line is the
  state, every line after the first an accepted write, appended under ``flock`` by one
  ``write`` (a SIGKILL leaves the line whole or absent); beside it ``<file>.read``, the
  highest fence that has read the key.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["FileLedger", "Ledger", "LedgerError", "PostgresLedger", "open_ledger"]

#: Seconds the parent's reads of a Postgres ledger try again while its server restarts (the
#: shared server is restarted by other test suites now and then).
PATIENCE = 60.0


class LedgerError(Exception):
    """The ledger's server failed: a write may or may not have landed (the journal says)."""


class Ledger:
    """The ledger's interface: ``read`` the counter, ``write`` it fenced, and the checker's
    reads."""

    def create(self, keys: Sequence[str]) -> None:
        raise NotImplementedError

    def read(self, key: str, fence: int | None = None) -> int:
        """The key's counter now; ``fence`` (registered first, atomically) refuses the writes
        of lower fences from now on."""
        raise NotImplementedError

    def write(
        self, key: str, fence: int, counter: int, then: Callable[[Any], None] | None = None
    ) -> bool:
        """Set the key's counter if ``fence`` is above the last accepted one and no higher
        fence has read; True if accepted (and journalled). ``then(cursor)``, if given, runs
        in the same transaction once accepted (Postgres only: the soak's
        ``record_success``)."""
        raise NotImplementedError

    def state(self) -> dict[str, tuple[int, int]]:
        """``{key: (counter, last fence)}``."""
        raise NotImplementedError

    def journal(self) -> dict[str, list[tuple[int, int]]]:
        """``{key: [(fence, counter), ...]}``: the accepted writes, in the order accepted."""
        raise NotImplementedError

    def dump(self) -> object:
        """Everything the ledger holds, as JSON-ready data, for a kept run's post-mortem."""
        return self.journal()

    def drop(self) -> None:
        """Remove the ledger's tables or files."""

    def close(self) -> None:
        """Let go of connections."""


class PostgresLedger(Ledger):
    def __init__(self, url: str, table: str) -> None:
        if not table.replace("_", "").isalnum():
            raise ValueError(f"ledger table must be letters, digits and _, not {table!r}")
        self.url, self.table = url, table
        self._connection: Any = None

    def _execute(
        self, sql: str, args: Sequence[Any] | dict[str, Any] = (), patience: float = 0.0
    ) -> Any:
        """Run one statement, on a new connection if the last one broke; try again for
        ``patience`` seconds (0 for a write, whose failure is ambiguous)."""
        import psycopg

        deadline = time.monotonic() + patience
        while True:
            try:
                if self._connection is None or self._connection.closed:
                    self._connection = psycopg.connect(
                        self.url, autocommit=True, connect_timeout=10
                    )
                return self._connection.execute(sql.replace("{t}", self.table), args)
            except psycopg.OperationalError as exc:
                if time.monotonic() >= deadline:
                    raise LedgerError(f"the ledger's server failed: {exc}") from exc
            time.sleep(0.2)

    def create(self, keys: Sequence[str]) -> None:
        # (table) | the ledger and its journal of accepted writes, a counter of 0 per key
        self._execute(
            "CREATE TABLE {t} (key text PRIMARY KEY, counter bigint NOT NULL,"
            " last_fence bigint NOT NULL, read_fence bigint NOT NULL DEFAULT 0)",
            patience=PATIENCE,
        )
        self._execute(
            "CREATE TABLE {t}_journal (id bigserial PRIMARY KEY, key text NOT NULL,"
            " fence bigint NOT NULL, counter bigint NOT NULL,"
            " at timestamptz NOT NULL DEFAULT clock_timestamp())",
            patience=PATIENCE,
        )
        # keys | a counter of 0 and a fence of 0 for each
        self._execute(
            "INSERT INTO {t} SELECT unnest(%s::text[]), 0, 0", (list(keys),), patience=PATIENCE
        )

    def read(self, key: str, fence: int | None = None) -> int:
        if fence is None:
            # key | the counter
            row = self._execute("SELECT counter FROM {t} WHERE key = %s", (key,)).fetchone()
            return int(row[0])
        # key, fence | the counter, read after the fence is registered (one statement)
        row = self._execute(
            "UPDATE {t} SET read_fence = greatest(read_fence, %(fence)s) WHERE key = %(key)s"
            " RETURNING counter",
            {"key": key, "fence": fence},
        ).fetchone()
        return int(row[0])

    def write(
        self, key: str, fence: int, counter: int, then: Callable[[Any], None] | None = None
    ) -> bool:
        # key, fence, counter | one journal row if accepted (fence above the last), else none
        sql = (
            "WITH changed AS (UPDATE {t} SET counter = %(counter)s, last_fence = %(fence)s"
            " WHERE key = %(key)s AND last_fence < %(fence)s AND read_fence <= %(fence)s"
            " RETURNING key)"
            " INSERT INTO {t}_journal (key, fence, counter)"
            " SELECT key, %(fence)s, %(counter)s FROM changed RETURNING id"
        )
        args = {"key": key, "fence": fence, "counter": counter}
        if then is None:
            return self._execute(sql, args).fetchone() is not None
        import psycopg

        self._execute("SELECT 1")  # a live connection, or a LedgerError before the write
        try:
            with self._connection.transaction():
                cursor = self._connection.execute(sql.replace("{t}", self.table), args)
                accepted = cursor.fetchone() is not None
                if accepted:
                    then(cursor)
        except psycopg.OperationalError as exc:
            raise LedgerError(f"the ledger's server failed: {exc}") from exc
        return accepted

    def state(self) -> dict[str, tuple[int, int]]:
        # | every key's counter and last fence
        rows = self._execute(
            "SELECT key, counter, last_fence FROM {t}", patience=PATIENCE
        ).fetchall()
        return {key: (int(counter), int(fence)) for key, counter, fence in rows}

    def written(self) -> int:
        """How many keys have been written (a counter above 0)."""
        # | the number of keys with a counter above 0
        row = self._execute("SELECT count(*) FROM {t} WHERE counter > 0", patience=PATIENCE)
        return int(row.fetchone()[0])

    def journal(self) -> dict[str, list[tuple[int, int]]]:
        # | the accepted writes in the order accepted
        rows = self._execute(
            "SELECT key, fence, counter FROM {t}_journal ORDER BY id", patience=PATIENCE
        ).fetchall()
        writes: dict[str, list[tuple[int, int]]] = {}
        for key, fence, counter in rows:
            writes.setdefault(key, []).append((int(fence), int(counter)))
        return writes

    def dump(self) -> object:
        # | the journal with the server's wall clock of each accepted write
        return self._execute(
            "SELECT id, key, fence, counter, extract(epoch FROM at)::float8 FROM {t}_journal"
            " ORDER BY id",
            patience=PATIENCE,
        ).fetchall()

    def drop(self) -> None:
        # (table) | both tables gone
        self._execute("DROP TABLE IF EXISTS {t}, {t}_journal", patience=PATIENCE)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


_LINE = 42  # "%020d %020d\n"
_FENCE = 20  # "%020d"


def _line(fence: int, counter: int) -> bytes:
    return f"{fence:020d} {counter:020d}\n".encode()


def _parse(line: bytes) -> tuple[int, int]:
    fence, counter = line.split()
    return int(fence), int(counter)


class FileLedger(Ledger):
    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._files: dict[str, int] = {}
        self._read_files: dict[str, int] = {}

    def _path(self, key: str) -> Path:
        return self.directory / hashlib.sha256(key.encode()).hexdigest()[:32]

    def _fd(self, key: str) -> int:
        fd = self._files.get(key)
        if fd is None:
            fd = self._files[key] = os.open(self._path(key), os.O_RDWR | os.O_APPEND)
        return fd

    def create(self, keys: Sequence[str]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "keys").write_text("".join(f"{key}\n" for key in keys))
        for key in keys:
            self._path(key).write_bytes(_line(0, 0))

    def _last(self, fd: int) -> tuple[int, int]:
        size = os.fstat(fd).st_size
        return _parse(os.pread(fd, _LINE, size - _LINE))

    def _read_fd(self, key: str) -> int:
        """The key's file ``<name>.read``: the highest fence that has read it, 20 digits
        written in place by one ``pwrite`` (a SIGKILL leaves it whole or as it was)."""
        fd = self._read_files.get(key)
        if fd is None:
            path = self._path(key).with_name(f"{self._path(key).name}.read")
            fd = self._read_files[key] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def _read_fence(self, key: str) -> int:
        """The highest fence that has read ``key`` (0 if none has)."""
        return int(os.pread(self._read_fd(key), _FENCE, 0) or b"0")

    def read(self, key: str, fence: int | None = None) -> int:
        fd = self._fd(key)
        fcntl.flock(fd, fcntl.LOCK_SH if fence is None else fcntl.LOCK_EX)
        try:
            if fence is not None and fence > self._read_fence(key):
                os.pwrite(self._read_fd(key), b"%020d" % fence, 0)
            return self._last(fd)[1]
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def write(
        self, key: str, fence: int, counter: int, then: Callable[[Any], None] | None = None
    ) -> bool:
        if then is not None:
            raise ValueError("the file ledger has no transactions to run `then` in")
        fd = self._fd(key)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if self._last(fd)[0] >= fence or self._read_fence(key) > fence:
                return False
            os.write(fd, _line(fence, counter))
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _lines(self, key: str) -> list[tuple[int, int]]:
        data = self._path(key).read_bytes()
        return [_parse(data[at : at + _LINE]) for at in range(0, len(data), _LINE)]

    def _keys(self) -> list[str]:
        return (self.directory / "keys").read_text().splitlines()

    def state(self) -> dict[str, tuple[int, int]]:
        last = {key: self._lines(key)[-1] for key in self._keys()}
        return {key: (counter, fence) for key, (fence, counter) in last.items()}

    def journal(self) -> dict[str, list[tuple[int, int]]]:
        return {key: self._lines(key)[1:] for key in self._keys()}

    def close(self) -> None:
        for fd in [*self._files.values(), *self._read_files.values()]:
            os.close(fd)
        self._files.clear()
        self._read_files.clear()


def open_ledger(spec: str) -> Ledger:
    """The ledger named by ``spec``: ``file:///dir`` or ``postgresql://...#table``."""
    if spec.startswith("file://"):
        return FileLedger(urlsplit(spec).path)
    if spec.startswith(("postgresql://", "postgres://")):
        url, _, table = spec.partition("#")
        return PostgresLedger(url, table)
    raise ValueError(f"ledger must be file:///dir or postgresql://...#table, not {spec!r}")
