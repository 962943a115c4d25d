"""The Postgres backend's schema: names, the statements of ``migrate()`` (``ddl``), and the
fence constants.

The SQLAlchemy declaration of the same tables is in
:mod:`celery_dlock.backends.postgres.schema`; a test checks that the two agree.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

__all__ = [
    "COMMENTS",
    "FENCE_GAP",
    "FENCE_START",
    "LOCK_SESSION",
    "Names",
    "ddl",
    "validate_names",
]

#: The first fence.
FENCE_START = 1

#: How far the fence sequence jumps after a crash (see ``Statements.restore_guard``): more
#: fences than a server can hand out in the WAL that a crash can lose (async commits are
#: flushed within 3 x wal_writer_delay; 10**9 is 10,000 s at 100,000 acquisitions/s).
FENCE_GAP = 10**9

#: A setting only a lock session's startup options set (``on``), read back when it opens:
#: a pooler that passes the options over (PgBouncer ``ignore_startup_parameters =
#: options``) leaves it unset, and session liveness cannot work through it.
LOCK_SESSION = "celery_dlock.lock_session"

#: Table comments (no quotes in them): what a reader of ``\\dt+`` learns about each table.
COMMENTS = {
    "locks": "celery_dlock: current leases; a row lives only as long as the session of its "
    "holder, hence UNLOGGED",
    "history": "celery_dlock: one record per ended lease",
    "successes": "celery_dlock: the last success with a result per key and task, for once",
    "fence_guard": "celery_dlock: emptied by crash recovery, after which fences move up",
}

_SCHEMA = re.compile(r"[a-z_][a-z0-9_]*\Z")
_PREFIX = re.compile(r"[a-z0-9_]*\Z")


def validate_names(schema: str, table_prefix: str) -> None:
    """Raise ``ValueError`` unless ``schema`` and ``table_prefix`` make plain identifiers."""
    if not _SCHEMA.match(schema) or len(schema) > 63:
        raise ValueError(
            f"schema {schema!r} must be lower-case letters, digits and _ (not first), "
            "at most 63 characters"
        )
    if not _PREFIX.match(table_prefix) or len(table_prefix) > 40:
        raise ValueError(
            f"table_prefix {table_prefix!r} must be lower-case letters, digits and _, "
            "at most 40 characters"
        )


@dataclass(frozen=True)
class Names:
    """Quoted, schema-qualified names of the backend's relations."""

    schema: str
    table_prefix: str

    def _q(self, name: str) -> str:
        return f'"{self.schema}"."{self.table_prefix}{name}"'

    def table(self, name: str) -> str:
        """The quoted, qualified name of table ``name`` (``locks``, ``history``...)."""
        return self._q(name)

    @property
    def locks(self) -> str:
        return self._q("locks")

    @property
    def history(self) -> str:
        return self._q("history")

    @property
    def successes(self) -> str:
        return self._q("successes")

    @property
    def guard(self) -> str:
        return self._q("fence_guard")

    @property
    def fence(self) -> str:
        return self._q("fence")

    def index(self, name: str) -> str:
        return f'"{self.table_prefix}{name}"'

    @property
    def ddl_lock_key(self) -> int:
        """The advisory key (negative: never a fence) that serialises DDL and guard repair."""
        digest = hashlib.blake2b(
            f"celery_dlock:{self.schema}:{self.table_prefix}".encode(), digest_size=7
        )
        return -1 - int.from_bytes(digest.digest(), "big")

    def key_space(self, purpose: str) -> int:
        """32 bits from the schema's names for ``purpose``: the high half of the leases'
        advisory keys (``lease``), or the first int4 of the two-int per-key advisory locks
        (``grant`` serialises grants of a key, ``queue`` orders its waiters)."""
        digest = hashlib.blake2b(
            f"celery_dlock:{purpose}:{self.schema}:{self.table_prefix}".encode(), digest_size=4
        )
        return int.from_bytes(digest.digest(), "big", signed=True)


_RECORD_COLUMNS = (
    "token text NOT NULL, "
    "fence bigint NOT NULL, "
    "holder json NOT NULL, "
    "acquired_at timestamptz NOT NULL, "
    "expires_at timestamptz, "
    "released_at timestamptz NOT NULL, "
    "outcome text NOT NULL, "
    "problem text, "
    "details text, "
    "result json"
)


def ddl(names: Names) -> list[str]:
    """The idempotent statements that create the schema (run by ``migrate()``).

    The locks table is UNLOGGED: its rows are only meaningful while their holders' sessions
    live, and a crash ends every session. History and kept results are normal tables.
    """
    n = names
    p = names.table_prefix
    return [
        f'CREATE SCHEMA IF NOT EXISTS "{n.schema}"',
        f"CREATE SEQUENCE IF NOT EXISTS {n.fence} AS bigint START WITH {FENCE_START} "
        "INCREMENT BY 1 CACHE 1 NO CYCLE",
        f"CREATE UNLOGGED TABLE IF NOT EXISTS {n.locks} ("
        'key text COLLATE "C" NOT NULL, '
        "token text NOT NULL, "
        "fence bigint NOT NULL, "
        "holder json NOT NULL, "
        "acquired_at timestamptz NOT NULL, "
        "expires_at timestamptz, "
        "backend_pid integer NOT NULL, "
        f'CONSTRAINT "{p}locks_pkey" PRIMARY KEY (key))',
        f"CREATE TABLE IF NOT EXISTS {n.history} ("
        'key text COLLATE "C" NOT NULL, '
        f"{_RECORD_COLUMNS}, "
        # One index serves as the key and for a key's records, newest first (read backwards).
        f'CONSTRAINT "{p}history_pkey" PRIMARY KEY (key, released_at, token))',
        # Most records are successes: only the others are indexed by outcome.
        f"CREATE INDEX IF NOT EXISTS {n.index('history_outcome_released_at')} "
        f"ON {n.history} (outcome, released_at) WHERE outcome <> 'succeeded'",
        f"CREATE INDEX IF NOT EXISTS {n.index('history_released_at')} ON {n.history} (released_at)",
        f"CREATE TABLE IF NOT EXISTS {n.successes} ("
        'key text COLLATE "C" NOT NULL, '
        "task_name text NOT NULL, "
        f"{_RECORD_COLUMNS}, "
        f'CONSTRAINT "{p}successes_pkey" PRIMARY KEY (key, task_name))',
        f"CREATE UNLOGGED TABLE IF NOT EXISTS {n.guard} ("
        "id integer NOT NULL, "
        "marked_at timestamptz NOT NULL, "
        f'CONSTRAINT "{p}fence_guard_pkey" PRIMARY KEY (id))',
        *(
            f"COMMENT ON TABLE {names.table(table)} IS '{comment}'"
            for table, comment in COMMENTS.items()
        ),
    ]
