"""How a Postgres lease is tied to its holder's lock session: an advisory lock per lease.

A lease's holder holds, on its lock session, an advisory lock whose bigint key is the
schema's lease space (32 bits from its name) over the low 32 bits of the fence: several
schemas can share a database (advisory keys are per database, fences per schema). In
``pg_locks`` it shows as locktype ``advisory``, mode ``ExclusiveLock``, ``objsubid`` 1 (the
single-bigint form), ``classid`` the space and ``objid`` the fence's low half, both unsigned
``oid``. Two live leases of one schema meet only if 2**32 fences were drawn while the first
was held; then the second acquire is refused (its lock is taken), never granted twice.
Waiters take the same key in share mode and the per-key locks use the two-int form
(``objsubid`` 2), so neither is ever mistaken for a holder.

A lease row whose ``backend_pid`` is :data:`HANDED_OVER` lives by its ttl alone; any other
is dead once no session holds its advisory lock: ``take_over`` takes its key, ``reap``
records it ``disconnected``, and ``get`` and ``leases`` say so (:meth:`LeaseKeys.ended`).
"""

from __future__ import annotations

from celery_dlock.backends.postgres.sql import Names

__all__ = ["HANDED_OVER", "LeaseKeys"]

#: ``backend_pid`` of a lease handed over (``hand_over``) or taken with ``liveness=ttl``:
#: alive by its ttl alone, no session stands for it (no server process has pid 0).
HANDED_OVER = 0


class LeaseKeys:
    """The advisory keys of a schema's leases, as SQL."""

    def __init__(self, names: Names) -> None:
        space = names.key_space("lease")
        self.space_oid = space & 0xFFFFFFFF
        self._high = space << 32

    def of(self, fence: str) -> str:
        """The bigint advisory key of the lease with fence ``fence``."""
        return f"({self._high}::int8 | ({fence} & 4294967295))"

    def held(self, where: str = "", select: str = "") -> str:
        """``pg_locks`` rows of lease keys that a session holds (extra conditions ``where``;
        columns ``select``)."""
        return (
            f"SELECT {select}FROM pg_catalog.pg_locks AS p WHERE p.locktype = 'advisory' "
            f"AND p.objsubid = 1 AND p.granted AND p.mode = 'ExclusiveLock' "
            f"AND p.classid = {self.space_oid}::oid{where} "
            "AND p.database = (SELECT oid FROM pg_catalog.pg_database "
            "WHERE datname = current_database())"
        )

    def live(self, fence: str) -> str:
        """SQL that is true while some session holds the advisory lock of lease ``fence``."""
        return f"EXISTS ({self.held(f' AND p.objid = ({fence} & 4294967295)::oid')})"

    def ended(self, alias: str) -> str:
        """SQL that is true when the lease row ``alias`` names a lock session and no session
        holds its advisory lock: its holder is gone, by the rule of ``take_over`` and
        ``reap``. An uncorrelated subquery, so ``pg_locks`` is read once per statement
        whatever the number of rows (a hashed subplan), not once per lease.

        Read after the statement's snapshot: a lease released in between shows once as
        ended (it was let go), and so does one handed over in between, which lives on: a
        read (``get``, ``leases``) may say so once; ``take_over`` and ``reap`` look at the
        row again as they change it, and leave a lease handed over alone."""
        return (
            f"({alias}.backend_pid <> {HANDED_OVER} AND ({alias}.fence & 4294967295)::oid "
            f"NOT IN ({self.held(select='p.objid ')}))"
        )
