"""The payments ledger: orders and charges, where every write carries the lease's fence.

The fence is what makes a lock safe for money: a holder that was paused past its lease
(GC, a stopped VM) wakes up holding a lease that is no longer current. The ledger keeps the
highest fence it has seen per lock key and refuses a write with a lower one, so such a
holder cannot charge twice. The check and the write happen in one transaction:

    UPDATE fences SET fence = :fence WHERE key = :key AND fence < :fence   -- 0 rows: stale

SQLite (the embedded default) or PostgreSQL (``DLOCK_EXAMPLE_LEDGER=postgresql://...``).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

__all__ = ["Ledger", "StaleFenceError"]


class StaleFenceError(RuntimeError):
    """A write carried a fence lower than one the ledger already saw for its key."""

    def __init__(self, key: str, fence: int, newest: int) -> None:
        super().__init__(key, fence, newest)
        self.key, self.fence, self.newest = key, fence, newest

    def __str__(self) -> str:
        return (
            f"stale fence {self.fence} for {self.key} (the ledger has seen {self.newest}): refused"
        )


SCHEMA = (
    "CREATE TABLE IF NOT EXISTS orders ("
    " id INTEGER PRIMARY KEY, customer TEXT NOT NULL, amount TEXT NOT NULL, card TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS charges ("
    " id {serial}, order_id INTEGER NOT NULL, amount TEXT NOT NULL, fence BIGINT NOT NULL,"
    " task_id TEXT, pid INTEGER NOT NULL, charged_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS refunds ("
    " id {serial}, order_id INTEGER NOT NULL, amount TEXT NOT NULL, fence BIGINT NOT NULL,"
    " refunded_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS fences (key TEXT PRIMARY KEY, fence BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS reports (id {serial}, day TEXT NOT NULL, total TEXT NOT NULL,"
    " fence BIGINT NOT NULL, made_at DOUBLE PRECISION NOT NULL)",
)


class Ledger:
    """The ledger behind one URL: ``sqlite:///abs/path.db`` or ``postgresql://...``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.postgres = url.startswith(("postgresql://", "postgres://"))
        if not self.postgres and not url.startswith("sqlite:///"):
            raise ValueError(f"ledger URL must be sqlite:///path or postgresql://..., not {url!r}")

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A cursor inside one write transaction (SQLite: BEGIN IMMEDIATE)."""
        if self.postgres:
            import psycopg

            with psycopg.connect(self.url) as connection, connection.cursor() as cursor:
                yield cursor
            return
        connection = sqlite3.connect(self.url[len("sqlite:///") - 1 :], timeout=30)
        connection.isolation_level = None
        try:
            cursor = connection.cursor()
            cursor.execute("BEGIN IMMEDIATE")
            try:
                yield cursor
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")
        finally:
            connection.close()

    def _sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.postgres else statement

    def create(self) -> None:
        serial = "BIGSERIAL PRIMARY KEY" if self.postgres else "INTEGER PRIMARY KEY AUTOINCREMENT"
        with self.transaction() as cursor:
            for statement in SCHEMA:
                cursor.execute(statement.format(serial=serial))

    def add_orders(self, orders: Sequence[tuple[int, str, Decimal, str]]) -> None:
        with self.transaction() as cursor:
            for order_id, customer, amount, card in orders:
                cursor.execute(
                    self._sql(
                        "INSERT INTO orders (id, customer, amount, card) VALUES (?, ?, ?, ?)"
                    ),
                    (order_id, customer, str(amount), card),
                )

    def order(self, order_id: int) -> tuple[str, Decimal, str]:
        with self.transaction() as cursor:
            cursor.execute(
                self._sql("SELECT customer, amount, card FROM orders WHERE id = ?"), (order_id,)
            )
            row = cursor.fetchone()
        if row is None:
            raise KeyError(f"no order {order_id}")
        return row[0], Decimal(row[1]), row[2]

    def _fenced(self, cursor: Any, key: str, fence: int) -> None:
        """Refuse a write whose fence is not newer than every fence seen for ``key``."""
        cursor.execute(
            self._sql("INSERT INTO fences (key, fence) VALUES (?, 0) ON CONFLICT (key) DO NOTHING"),
            (key,),
        )
        cursor.execute(
            self._sql("UPDATE fences SET fence = ? WHERE key = ? AND fence < ?"),
            (fence, key, fence),
        )
        if cursor.rowcount != 1:
            cursor.execute(self._sql("SELECT fence FROM fences WHERE key = ?"), (key,))
            raise StaleFenceError(key, fence, int(cursor.fetchone()[0]))

    def charge(
        self,
        key: str,
        fence: int,
        *,
        order_id: int,
        amount: Decimal,
        task_id: str | None,
        pid: int,
        then: Callable[[Any, int], None] | None = None,
    ) -> int:
        """Write one charge under ``fence``; returns its id. ``then(cursor, charge_id)``
        runs in the same transaction, before it commits (the task keeps its ``once``
        success there, so the charge and its memory commit together)."""
        with self.transaction() as cursor:
            self._fenced(cursor, key, fence)
            cursor.execute(
                self._sql(
                    "INSERT INTO charges (order_id, amount, fence, task_id, pid, charged_at)"
                    " VALUES (?, ?, ?, ?, ?, ?) RETURNING id"
                ),
                (order_id, str(amount), fence, task_id, pid, time.time()),
            )
            charge_id = int(cursor.fetchone()[0])
            if then is not None:
                then(cursor, charge_id)
            return charge_id

    def refund(self, key: str, fence: int, order_id: int, amount: Decimal) -> None:
        with self.transaction() as cursor:
            self._fenced(cursor, key, fence)
            cursor.execute(
                self._sql(
                    "INSERT INTO refunds (order_id, amount, fence, refunded_at) VALUES (?, ?, ?, ?)"
                ),
                (order_id, str(amount), fence, time.time()),
            )

    def report(self, key: str, fence: int, day: str) -> Decimal:
        with self.transaction() as cursor:
            self._fenced(cursor, key, fence)
            cursor.execute("SELECT amount FROM charges")
            total = sum((Decimal(row[0]) for row in cursor.fetchall()), Decimal(0))
            cursor.execute(
                self._sql("INSERT INTO reports (day, total, fence, made_at) VALUES (?, ?, ?, ?)"),
                (day, str(total), fence, time.time()),
            )
        return total

    def charges_per_order(self) -> dict[int, int]:
        with self.transaction() as cursor:
            cursor.execute(
                "SELECT o.id, COUNT(c.id) FROM orders o"
                " LEFT JOIN charges c ON c.order_id = o.id GROUP BY o.id ORDER BY o.id"
            )
            return {int(order_id): int(count) for order_id, count in cursor.fetchall()}
