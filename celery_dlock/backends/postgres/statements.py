"""Every statement the Postgres backend runs, built once per schema and table prefix.

Each is one autocommit round trip; values travel as parameters (``wait`` is bound on the
client, since it is several statements in one message). The hot ones, ``acquire`` and
``release``, are single plain DML statements: a busy key costs a second statement
(``take_over``), an uncontended pair costs two.

Liveness, the advisory lock that ties a lease to its lock session: see
:mod:`celery_dlock.backends.postgres.advisory`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from psycopg.types.numeric import Int8

from celery_dlock.backends.postgres.advisory import HANDED_OVER, LeaseKeys
from celery_dlock.backends.postgres.sql import FENCE_GAP, LOCK_SESSION, Names

__all__ = ["HANDED_OVER", "Statements"]


def _epoch(column: str) -> str:
    # Exact: numeric seconds with six decimals, rounded once to the nearest float8.
    return f"extract(epoch FROM {column})::float8"


def _lease(alias: str) -> str:
    a = alias
    return f"{a}.key, {a}.token, {a}.fence, {a}.holder, " + ", ".join(
        _epoch(f"{a}.{column}") for column in ("acquired_at", "expires_at")
    )


def _record(alias: str) -> str:
    a = alias
    return (
        f"{_lease(a)}, {_epoch(f'{a}.released_at')}, {a}.outcome, {a}.problem, {a}.details, "
        f"{a}.result"
    )


_TTL = "clock_timestamp() + %(ttl)s::float8 * interval '1 second'"
#: A record's columns but its key, in the order of the history and success tables.
_RECORD = (
    "token, fence, holder, acquired_at, expires_at, released_at, outcome, problem, details, result"
)
_COLUMNS = f"token, key, {_RECORD.removeprefix('token, ')}"
_ENDED = (
    "CASE WHEN {0} = 'disconnected' THEN 'the lock session of the holder (backend pid ' "
    "|| {1} || ') ended' END"
)


class Statements:
    """Every statement of the backend, for one schema and table prefix."""

    def __init__(self, names: Names, *, session: bool = True) -> None:
        """``session``: leases live while their lock session holds an advisory lock;
        False (``liveness=ttl``): by their ttl alone, each row's backend pid is
        ``HANDED_OVER``, and no statement leaves state on the session."""
        self.names = n = names
        self.keys = keys = LeaseKeys(n)
        pid = "pg_backend_pid()" if session else str(HANDED_OVER)
        # Grants of one key are serialised by a transaction advisory lock on the key, taken
        # before nextval(): INSERT ... ON CONFLICT computes its values before it waits on a
        # conflicting row, and without this an acquirer that waited could be granted with a
        # fence drawn before its predecessor's.
        grant = f"pg_advisory_xact_lock({n.key_space('grant')}, hashtext(%(key)s))"
        queue = f"{n.key_space('queue')}, hashtext(%(key)s)"
        locked = f"pg_try_advisory_lock({keys.of('fence')})" if session else "true"
        returning = f"fence, {_epoch('acquired_at')}, {_epoch('expires_at')}, {locked}, {pid}"
        # NULL, refused by NOT NULL, while a crash or a failover left the guard empty: see store.py
        self.next_fence = f"CASE WHEN EXISTS (SELECT FROM {n.guard}) THEN nextval('{n.fence}') END"
        insert = (
            f"INSERT INTO {n.locks} (key, token, fence, holder, acquired_at, expires_at, "
            "backend_pid)\n"
            f"SELECT %(key)s, %(token)s, {self.next_fence}, %(holder)s::json, "
            f"clock_timestamp(), {_TTL}, {pid} FROM {grant}"
        )
        tail = f"\nON CONFLICT (key) DO NOTHING\nRETURNING {returning}"
        self.acquire = (
            "-- acquire: key, token, holder, ttl | the new lease's (fence, acquired_at, "
            "expires_at, advisory lock taken, backend pid); no row when the key is held\n"
            f"{insert}{tail}"
        )
        self.acquire_politely = (
            "-- acquire_politely: as acquire, but no row also while a waiter of the key is "
            "first in its queue (for a process that has just released the key)\n"
            f"{insert}\nWHERE pg_try_advisory_xact_lock_shared({queue}){tail}"
        )
        self._take_over(grant, returning, pid)
        self._releasing(queue)
        self.unlock = (
            "-- unlock: fence | let go of the advisory lock of a lease that is no longer ours\n"
            f"SELECT pg_advisory_unlock({keys.of('%(fence)s::int8')})"
        )
        self._recording(n)
        self.hand_over = (
            "-- hand_over: key, token, ttl, if_unchanged, seen | (acquired_at, expires_at, "
            "advisory lock let go) of the lease, alive by its ttl alone, never shortened (with "
            "if_unchanged, its expiry kept unless still the one seen); no row when not ours\n"
            f"UPDATE {n.locks} SET expires_at = CASE WHEN %(if_unchanged)s AND expires_at IS NOT "
            f"NULL AND {_epoch('expires_at')} IS DISTINCT FROM %(seen)s::float8 THEN expires_at "
            f"ELSE GREATEST(expires_at, {_TTL}) END, backend_pid = "
            f"{HANDED_OVER} WHERE key = %(key)s AND token = %(token)s "
            "AND (expires_at IS NULL OR expires_at > clock_timestamp()) "
            f"RETURNING {_epoch('acquired_at')}, {_epoch('expires_at')}, "
            f"CASE WHEN %(unlock)s THEN pg_advisory_unlock({keys.of('fence')}) END"
        )
        self.renew = (
            "-- renew: key, token, ttl | (acquired_at, expires_at); no row when not ours or "
            "expired\n"
            f"UPDATE {n.locks} SET expires_at = {_TTL} WHERE key = %(key)s AND token = %(token)s "
            "AND (expires_at IS NULL OR expires_at > clock_timestamp()) "
            f"RETURNING {_epoch('acquired_at')}, {_epoch('expires_at')}"
        )
        self.sweep = (
            "-- sweep: fences and keys of leases this session holds | the fences whose lease "
            "is gone (taken over by its retry elsewhere, force-released, reaped), unlocked\n"
            f"SELECT h.fence, pg_advisory_unlock({keys.of('h.fence')}) "
            "FROM unnest(%(fences)s::int8[], %(keys)s::text[]) AS h(fence, key) "
            f"WHERE NOT EXISTS (SELECT FROM {n.locks} AS l WHERE l.key = h.key "
            "AND l.fence = h.fence)"
        )
        self._reading(n)
        self._janitor(n)
        self._session(n, session)
        self._waiting(n)

    def _recording(self, n: Names) -> None:
        """Records written outside a release, and successes kept for ``once``."""
        add = (
            f"INSERT INTO {n.history} ({_COLUMNS})\n"
            "VALUES (%(token)s, %(key)s, %(fence)s, %(holder)s::json, %(acquired_at)s, "
            "%(expires_at)s, %(released_at)s, %(outcome)s, %(problem)s, %(details)s, "
            "%(result)s::json)\n"
            "ON CONFLICT DO NOTHING"
        )
        self.add_record = f"-- add_record: the record's fields | -\n{add}"
        self.add_record_success = (
            "-- add_record_success: the record's fields | -; also the last success of its "
            "key and task\n"
            f"WITH rec AS ({add}\n  RETURNING {_COLUMNS}),\n"
            f"{self._success()}\n"
            "SELECT count(*) FROM success"
        )
        keep = (
            f"INSERT INTO {n.successes} (key, task_name, {_RECORD})\n"
            "SELECT %(key)s, %(task_name)s, %(token)s, %(fence)s, CAST(%(holder)s AS json), "
            "%(acquired_at)s, %(expires_at)s, %(released_at)s, 'succeeded', %(problem)s, "
            "%(details)s, CAST(%(result)s AS json){source}\n"
            "ON CONFLICT (key, task_name) {conflict}\nRETURNING 1"
        )
        durable = "\nFROM (SELECT set_config('synchronous_commit', 'on', true)) AS durable"
        again = ", ".join(f"{column} = excluded.{column}" for column in _RECORD.split(", ")[1:])
        ours = f"DO UPDATE SET {again}\n  WHERE {n.successes}.token = excluded.token"
        self.remember = (
            "-- remember: a success record's fields, its task name | 1 when kept; no row when "
            "another lease's success of that key and task is kept (first wins; the lease's "
            "own, by token, is updated); committed durably\n"
            + keep.format(source=durable, conflict=ours)
        )
        self.record_success = (
            "-- record_success: as remember, in the caller's own transaction and connection "
            "(psycopg or psycopg2), committed by the caller; the run's own (token) is updated\n"
            + keep.format(source="", conflict=ours)
        )

    def _take_over(self, grant: str, returning: str, pid: str) -> None:
        n, keys = self.names, self.keys
        # ``cur`` reads the row as of the statement's start and ``pg_locks`` as it is when
        # read: a hand-over committed in between (it lets go of the advisory lock) shows as
        # ``disconnected``. The UPDATE sees the row as it is now (READ COMMITTED re-checks
        # its WHERE on the new version), so it checks again that no hand-over came first.
        self.take_over = (
            "-- take_over: key, token, holder, ttl, replace, retried details, fences this "
            "session holds | (the old lease's outcome: retried, expired or disconnected, "
            "fence, acquired_at, expires_at, advisory lock taken, backend pid, old fence, old "
            "fence unlocked) of the new lease, the old one recorded; no row when its holder lives\n"
            f"WITH grant_ AS MATERIALIZED (SELECT FROM {grant}),\n"
            "cur AS MATERIALIZED (\n"
            "  SELECT l.*, CASE WHEN l.token = %(replace)s THEN 'retried' "
            "WHEN l.expires_at <= clock_timestamp() THEN 'expired' "
            f"WHEN l.backend_pid <> {HANDED_OVER} AND NOT {keys.live('l.fence')} "
            "THEN 'disconnected' END AS ended\n"
            f"  FROM grant_, {n.locks} AS l WHERE l.key = %(key)s),\n"
            "taken AS (\n"
            f"  UPDATE {n.locks} AS l SET token = %(token)s, fence = {self.next_fence}, "
            "holder = %(holder)s::json, acquired_at = clock_timestamp(), "
            f"expires_at = {_TTL}, backend_pid = {pid}\n"
            "  FROM cur WHERE cur.ended IS NOT NULL AND l.key = cur.key "
            "AND l.token = cur.token AND (cur.ended <> 'expired' "
            "OR l.expires_at <= clock_timestamp()) "
            f"AND (cur.ended <> 'disconnected' OR l.backend_pid <> {HANDED_OVER})\n"
            "  RETURNING l.fence, l.acquired_at, l.expires_at),\n"
            "fresh AS (\n"
            f"  INSERT INTO {n.locks} (key, token, fence, holder, acquired_at, expires_at, "
            "backend_pid)\n"
            f"  SELECT %(key)s, %(token)s, {self.next_fence}, %(holder)s::json, "
            f"clock_timestamp(), {_TTL}, {pid} WHERE NOT EXISTS (SELECT FROM cur)\n"
            "  ON CONFLICT (key) DO NOTHING\n"
            "  RETURNING fence, acquired_at, expires_at),\n"
            "ended AS (\n"
            f"  INSERT INTO {n.history} ({_COLUMNS})\n"
            "  SELECT cur.token, cur.key, cur.fence, cur.holder, cur.acquired_at, "
            "cur.expires_at, clock_timestamp(), cur.ended, NULLIF(cur.ended, 'retried'), "
            "CASE WHEN cur.ended = 'retried' THEN %(retried)s ELSE "
            f"{_ENDED.format('cur.ended', 'cur.backend_pid')} END, NULL\n"
            "  FROM cur WHERE EXISTS (SELECT FROM taken)\n"
            "  RETURNING outcome),\n"
            "new AS MATERIALIZED (\n"
            "  SELECT taken.*, cur.fence AS old FROM taken, cur\n"
            "  UNION ALL SELECT fresh.*, NULL FROM fresh)\n"
            f"SELECT (SELECT outcome FROM ended), {returning}, "
            "old, CASE WHEN old = ANY(%(held)s::int8[]) "
            f"THEN pg_advisory_unlock({keys.of('old')}) END "
            "FROM new"
        )

    def _releasing(self, queue: str) -> None:
        n, keys = self.names, self.keys
        gone = (
            "WITH gone AS (\n"
            f"  DELETE FROM {n.locks} WHERE key = %(key)s AND token = %(token)s\n"
            "  RETURNING key, token, fence, holder, acquired_at, expires_at, "
            "coalesce(expires_at <= now(), false) AS expired)"
        )

        def record(problem: str, details: str, result: str) -> str:
            return (
                f"INSERT INTO {n.history} AS h ({_COLUMNS})\n"
                "SELECT token, key, fence, holder, acquired_at, expires_at, now(), "
                "CASE WHEN expired THEN 'expired' ELSE %(outcome)s END, "
                f"CASE WHEN expired THEN 'expired' ELSE {problem} END, "
                f"CASE WHEN expired THEN NULL ELSE {details} END, "
                f"CASE WHEN expired THEN NULL ELSE {result}::json END\n"
                "FROM gone"
            )

        given = record("%(problem)s", "%(details)s", "%(result)s")
        outcome = (
            f"{_epoch('released_at')}, outcome, {_epoch('acquired_at')}, {_epoch('expires_at')}"
        )
        waiters = f"NOT pg_try_advisory_xact_lock_shared({queue})"
        # RETURNING runs after the row and its index entries are in: a failed write leaves
        # the advisory lock, and with it the lease, as it was.
        returning = (
            f"RETURNING {outcome}, CASE WHEN %(unlock)s "
            f"THEN pg_advisory_unlock({keys.of('fence')}) END, {waiters}"
        )
        self.release = (
            "-- release: key, token, outcome, problem, details, result, unlock | (released_at, "
            "outcome, acquired_at, expires_at, -, whether waiters queue for the key) of the "
            "record; no row when the lease was not ours; an expired lease is recorded as "
            "expired\n"
            f"{gone}\n{given}\n{returning}"
        )
        self.release_bare = (
            "-- release_bare: as release, with no problem, details or result (the usual "
            "release: fewer parameters)\n"
            f"{gone}\n{record('NULL', 'NULL', 'NULL')}\n{returning}"
        )
        # A once result is what stops a payment from running twice: its commit waits for
        # the WAL flush even on a lock session that commits asynchronously. set_config(...,
        # true) lasts until this statement's implicit transaction ends, and the commit
        # reads it then (measured: 0 of 200 such commits unflushed right after, 200 of 200
        # without it).
        self.release_success = (
            "-- release_success: as release, and the record becomes the last success of its "
            "key and task (for once), committed durably\n"
            f"{gone},\n"
            f"rec AS ({given}\n  RETURNING {_COLUMNS}),\n"
            f"{self._success()},\n"
            "durable AS (SELECT set_config('synchronous_commit', 'on', true) AS on)\n"
            f"SELECT {outcome}, CASE WHEN (SELECT count(*) FROM success) >= 0 "
            "AND (SELECT count(*) FROM durable) = 1 "
            f"AND %(unlock)s THEN pg_advisory_unlock({keys.of('fence')}) END, {waiters} "
            "FROM rec"
        )

    def _success(self) -> str:
        """A CTE: ``rec``'s success kept for its key and task unless another lease's is."""
        n = self.names
        columns = f"key, task_name, {_RECORD}"
        updates = ", ".join(f"{c} = excluded.{c}" for c in _RECORD.split(", "))
        return (
            "success AS (\n"
            f"  INSERT INTO {n.successes} ({columns})\n"
            f"  SELECT key, holder->>'task_name', {_RECORD}\n"
            "  FROM rec WHERE outcome = 'succeeded' AND result IS NOT NULL "
            "AND holder->>'task_name' IS NOT NULL\n"
            f"  ON CONFLICT (key, task_name) DO UPDATE SET {updates}\n"
            f"  WHERE {n.successes}.token = excluded.token\n"
            "  RETURNING 1)"
        )

    def _reading(self, n: Names) -> None:
        # Each lease with whether its holder's lock session ended (its holder is gone
        # before take_over or reap finds it): one read of pg_locks for all of them.
        listed = f"SELECT {_lease('l')}, {self.keys.ended('l')} FROM {n.locks} AS l"
        self.get = (
            "-- get: key | the lease on key, if any, and whether its lock session ended\n"
            f"{listed} WHERE l.key = %(key)s"
        )
        self.leases = (
            "-- leases: prefix | leases whose key starts with prefix, by key, and whether "
            "the lock session of each ended\n"
            f"{listed} WHERE starts_with(l.key, %(prefix)s) ORDER BY l.key"
        )
        self._history = f"SELECT {_record('h')} FROM {n.history} AS h"
        self.settings = (
            "-- settings: names | (name, setting) of the session, and its backend pid\n"
            "SELECT name, setting FROM pg_catalog.pg_settings WHERE name = ANY(%(names)s) "
            "UNION ALL SELECT 'backend_pid', pg_backend_pid()::text"
        )
        self.record_of = (
            "-- record_of: key, token | the record of that lease, if it ended\n"
            f"SELECT {_record('h')} FROM {n.history} AS h WHERE h.key = %(key)s "
            "AND h.token = %(token)s"
        )
        self.last_success = (
            "-- last_success: key, task_name | the newest succeeded record of that task\n"
            f"SELECT {_record('h')} FROM {n.successes} AS h WHERE h.key = %(key)s "
            "AND h.task_name = %(task_name)s"
        )

    def history_of(
        self, key: str | None, outcome: str | None, since: datetime | None, limit: int | None
    ) -> tuple[str, dict[str, Any]]:
        """The history query for these filters (each one given is a condition), newest
        first, and its parameters."""
        given = {"key": key, "outcome": outcome, "since": since}
        where = [
            f"h.released_at >= %({name})s" if name == "since" else f"h.{name} = %({name})s"
            for name, value in given.items()
            if value is not None
        ]
        params: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
        statement = self._history
        if where:
            statement += " WHERE " + " AND ".join(where)
        statement += " ORDER BY h.released_at DESC, h.fence DESC"
        if limit is not None:
            statement += " LIMIT %(limit)s"
            params["limit"] = Int8(limit)
        return f"-- history: filters | records, newest first\n{statement}", params

    def _janitor(self, n: Names) -> None:
        n_keys_held = self.keys.held(select="p.objid::int8 AS low ")
        unlock = f"pg_advisory_unlock({self.keys.of('fence')})"
        self.reap = (
            "-- reap: limit, fences this session holds | records of cleared leases\n"
            "WITH live AS MATERIALIZED (\n"
            f"  {n_keys_held}),\n"
            "dead AS (\n"
            "  SELECT l.key, l.token, CASE WHEN l.expires_at <= now() THEN 'expired' "
            "ELSE 'disconnected' END AS outcome\n"
            f"  FROM {n.locks} AS l WHERE l.expires_at <= now() "
            f"OR (l.backend_pid <> {HANDED_OVER} "
            "AND NOT EXISTS (SELECT FROM live WHERE live.low = l.fence & 4294967295))\n"
            "  ORDER BY l.fence LIMIT %(limit)s FOR UPDATE SKIP LOCKED),\n"
            "gone AS (\n"
            f"  DELETE FROM {n.locks} AS l USING dead WHERE l.key = dead.key "
            "AND l.token = dead.token RETURNING l.*, dead.outcome)\n"
            f"INSERT INTO {n.history} AS h ({_COLUMNS})\n"
            "SELECT token, key, fence, holder, acquired_at, expires_at, now(), outcome, "
            f"outcome, {_ENDED.format('outcome', 'backend_pid')}, NULL FROM gone\n"
            f"RETURNING {_record('h')}, CASE WHEN fence = ANY(%(held)s::int8[]) "
            f"THEN {unlock} END"
        )
        self.prune = (
            "-- prune: before, batch | records deleted in this batch\n"
            f"DELETE FROM {n.history} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {n.history} "
            "WHERE released_at < %(before)s LIMIT %(batch)s))"
        )
        self.forget_success = (
            "-- forget_success: key, task_name, token | the kept success deleted, if that "
            "lease kept it\n"
            f"DELETE FROM {n.successes} WHERE key = %(key)s AND task_name = %(task_name)s "
            "AND token = %(token)s"
        )

    def _session(self, n: Names, session: bool) -> None:
        # A lock session must outlive idle_session_timeout; with liveness=ttl nothing is
        # set on a session (a pooler hands its server connection to others).
        idle = (
            ", CASE WHEN current_setting('server_version_num')::int >= 140000 "
            "THEN set_config('idle_session_timeout', '0', false) END"
        )
        self.open = (
            "-- open: | backend pid, whether the tables exist; a lock session: its startup "
            f"option {LOCK_SESSION} as the server got it, idle_session_timeout off\n"
            "SELECT pg_backend_pid(), "
            + " AND ".join(
                f"to_regclass('{name}') IS NOT NULL"
                for name in (n.locks, n.history, n.successes, n.guard, n.fence)
            )
            + (f", current_setting('{LOCK_SESSION}', true){idle}" if session else "")
        )
        self.check = (
            "-- check: | backend pid (again, in a second transaction), fence guard present\n"
            f"SELECT pg_backend_pid(), EXISTS (SELECT FROM {n.guard})"
        )
        # A crash empties the UNLOGGED guard. The fences handed out in the WAL it lost may
        # come again from the sequence: move it past them, durably, before any acquire.
        self.restore_guard = [
            "SET LOCAL synchronous_commit = on",
            f"SELECT pg_advisory_xact_lock({n.ddl_lock_key})",
            f"SELECT setval('{n.fence}', (SELECT last_value FROM {n.fence}) + {FENCE_GAP}) "
            f"WHERE NOT EXISTS (SELECT FROM {n.guard})",
            f"INSERT INTO {n.guard} (id, marked_at) VALUES (1, now()) ON CONFLICT DO NOTHING",
        ]
        self.sequence_exists = f"SELECT to_regclass('{n.fence}') IS NOT NULL"
        self.mark_guard = (
            f"INSERT INTO {n.guard} (id, marked_at) VALUES (1, now()) ON CONFLICT DO NOTHING"
        )

    def _waiting(self, n: Names) -> None:
        remaining = (
            "greatest(1, least(%(ms)s - extract(epoch FROM clock_timestamp() - "
            "statement_timestamp()) * 1000, ceil(extract(epoch FROM l.expires_at - "
            "clock_timestamp()) * 1000)))::int8::text"
        )
        # A lease handed over has no session to wait on: a short nap, then the caller
        # tries again (polling, for the rare waiter on a dedupe mark).
        on_holder = (
            "SELECT CASE WHEN l.expires_at <= clock_timestamp() THEN 'expired' "
            f"WHEN l.backend_pid = {HANDED_OVER} THEN (SELECT 'polled' FROM pg_sleep("
            "least(%(ms)s / 1000.0, 0.05 + random() * 0.05))) "
            f"WHEN set_config('lock_timeout', {remaining}, true) IS NULL THEN NULL "
            f"WHEN (SELECT true FROM pg_advisory_xact_lock_shared({self.keys.of('l.fence')})) "
            f"IS NULL THEN NULL ELSE 'released' END FROM {n.locks} AS l WHERE l.key = %(key)s"
        )
        header = (
            "-- wait: key, timeout ms (bound on the client: several statements, one round "
            "trip) | returns when the holder lets go or is gone, or the lease expires; "
            "SQLSTATE 55P03 when the timeout ran out first. The settings are local to the "
            "message's implicit transaction."
        )
        self.wait = (
            f"{header} Waiters of a key queue on its queue lock (kept by the session after "
            "the wait: the thread's place at the head until it acquires), and only the first "
            "waits on the holder, so a release wakes one.\n"
            "SELECT set_config('lock_timeout', %(ms)s::text, true);\n"
            f"SELECT pg_advisory_lock({n.key_space('queue')}, hashtext(%(key)s));\n"
            f"{on_holder}"
        )
        self.wait_again = (
            f"{header} For a waiter that holds the key's queue lock already.\n"
            "SELECT set_config('lock_timeout', %(ms)s::text, true);\n"
            f"{on_holder}"
        )
        self.leave_queue = (
            "-- leave_queue: | the waiter connection's queue lock (its only session advisory "
            "lock) let go: the next waiter's turn\n"
            "SELECT pg_advisory_unlock_all()"
        )
