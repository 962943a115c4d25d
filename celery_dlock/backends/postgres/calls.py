"""The parameters of the Postgres backend's hot statements and the reading of their rows,
apart from how they are run: the blocking lock session (``PostgresBackend``) and the
asyncio one (``AsyncPostgres``) share these."""

from __future__ import annotations

from typing import Any

from celery_dlock.backends.base import remembered
from celery_dlock.backends.postgres import rows
from celery_dlock.backends.postgres.statements import Statements
from celery_dlock.records import DETAILS_LIMIT, Lease, Outcome, Record

__all__ = ["Release"]


class Release:
    """One release: its statement and parameters, and the record its row stands for."""

    __slots__ = ("details", "lease", "outcome", "params", "problem", "result", "statement")

    def __init__(
        self,
        sql: Statements,
        lease: Lease,
        outcome: Outcome,
        *,
        problem: str | None,
        details: str | None,
        result: Any,
    ) -> None:
        self.lease = lease
        self.outcome = outcome = Outcome(outcome)
        self.problem = problem = rows.text(problem, rows.PROBLEM_LIMIT)
        self.details = details = rows.text(details, DETAILS_LIMIT)
        result_json, self.result = rows.result_json(result)
        self.params: dict[str, Any] = {"key": lease.key, "token": lease.token}
        self.params |= {"outcome": outcome.value, "problem": problem, "details": details}
        self.params["result"] = result_json
        if remembered(outcome, self.result, lease.holder.task_name) is not None:
            self.statement = sql.release_success
        elif problem is None and details is None and result_json is None:
            self.statement = sql.release_bare
        else:
            self.statement = sql.release

    def record(self, row: Any) -> Record | None:
        """The record of a release whose statement returned ``row``; None if the lease ran
        out before it (recorded ``expired`` then)."""
        if row[1] == Outcome.EXPIRED.value and self.outcome is not Outcome.EXPIRED:
            return None
        lease = self.lease
        held = Lease(lease.key, lease.token, lease.fence, lease.holder, row[2], row[3])
        return Record(held, row[0], self.outcome, self.problem, self.details, self.result)
