"""``marks [--release-ran]``: the dedupe marks held now, and for each whether the store
shows that its message has run.

A store that loses a mark's *release* brings the mark back, held for a message that has
already run: every call of its key is then coalesced into that message, with no run after
it, until the mark's ``dedupe_ttl`` ends (an hour by default). A Redis restarted from its
snapshot or from an AOF written every second does that, and so does a failover without
``replicas=N``. ``--release-ran`` releases such marks, each by its token, recorded
``forced``.

A message has run when the last body lease of its task id on the mark's lock key (or on a
slot of it) ended in a way that ends the task (:mod:`celery_dlock.marks`, which the janitor
uses to release such marks itself, within its bounds). A mark whose task holds a body lease
now is shown as running and left alone. Neither is looked for past the newest
:data:`~celery_dlock.cli.commands.RECENT` records of each key.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import click

from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.common import store_now
from celery_dlock.cli.commands import JSON, RECENT, confirmed, operator, records_of
from celery_dlock.cli.env import Env, guarded
from celery_dlock.cli.render import human_duration, lease_json, record_json, table
from celery_dlock.marks import bodies_held, ended_task, last_run, lock_key_of, release_ran
from celery_dlock.records import Lease, Record

__all__ = ["Mark", "marks", "survey"]

#: Seconds of clock difference allowed for when the history is searched from a mark's grant.
SKEW = 600.0


@dataclass(frozen=True)
class Mark:
    """A dedupe mark held now, the key its task locks, and what the store shows of its run."""

    lease: Lease
    lock_key: str
    #: A body lease of the mark's task id held now.
    running: Lease | None
    #: The record of the last body lease of that task id, when it ended its task.
    ran: Record | None


def survey(backend: LockBackend, prefix: str) -> list[Mark]:
    """The dedupe marks held under ``prefix``, each with what the store shows of its run."""
    found = []
    listed = backend.leases(prefix)
    for lease in listed:
        lock_key = lock_key_of(lease)
        if lock_key is None:
            continue
        body = bodies_held(backend, listed, prefix, lease, lock_key, slots=True)
        since = lease.acquired_at - SKEW
        query = functools.partial(backend.history, since=since, limit=RECENT)
        records, _ = records_of(backend, lock_key, query, limit=RECENT)
        last = last_run(records, lease)
        ran = last if last is not None and ended_task(last) else None
        found.append(Mark(lease, lock_key, body[0] if body else None, ran))
    return found


@click.command()
@click.argument("prefix", required=False)
@click.option(
    "--release-ran",
    is_flag=True,
    help="Release the marks whose message has run (after a store lost their releases).",
)
@click.option("--force", is_flag=True, help="Do not ask for confirmation.")
@JSON
@guarded
def marks(env: Env, prefix: str | None, *, release_ran: bool, force: bool, as_json: bool) -> None:
    """List the dedupe marks held now, and whether their message has run.

    Shows each mark under PREFIX (default: the namespace): its key, task id, age, and what
    the store shows of its message: queued (no run of it seen), running (its body holds
    the lock), or ran (its body ended: succeeded, failed, revoked or skipped), with when.
    A mark whose message ran is one a store brought back after losing its release (a Redis
    restarted from its snapshot, a failover without replicas=N): calls for its key are
    coalesced into it, and none runs, until its dedupe_ttl ends. --release-ran releases
    those, each by its token (a mark taken since is left alone), recorded as forced, after
    asking unless --force. Exit code 0 unless a mark to release could not be.
    """
    chosen = env.target.prefix if prefix is None else prefix
    found = survey(env.backend, chosen)
    now = store_now(env.backend)
    ran = [mark for mark in found if mark.ran is not None and mark.running is None]
    released: list[Record] = []
    if release_ran and ran:
        env.echo(table(*_rows(ran, now)), err=as_json)
        question = f"Release these {len(ran)} marks, recorded as forced?"
        if force or confirmed(env, question, err=as_json):
            released = _release(env, ran)
    if as_json:
        env.emit_json(
            {
                "backend": env.url,
                "prefix": chosen,
                "marks": [_mark_json(mark, now) for mark in found],
                "released": [record_json(record) for record in released],
            }
        )
    elif not release_ran:
        if not found:
            env.echo(f"no dedupe marks under {chosen!r} in {env.url}")
        else:
            env.echo(table(*_rows(found, now)))
    elif not ran:
        env.echo(f"no mark under {chosen!r} is held for a message that has run")
    else:
        env.echo(f"released {len(released)} of {len(ran)} marks whose message had run")
    if len(released) < (len(ran) if release_ran else 0):  # declined, or one changed hands
        click.get_current_context().exit(1)


def _release(env: Env, ran: list[Mark]) -> list[Record]:
    """Release each mark of ``ran`` by its token, recorded ``forced``; the records."""
    found = [(mark.lease, mark.ran) for mark in ran if mark.ran is not None]
    return release_ran(env.backend, found, f"{operator()} with celery-dlock marks --release-ran")


def _state(mark: Mark, now: float) -> str:
    if mark.running is not None:
        return f"running (fence {mark.running.fence})"
    if mark.ran is not None:
        return f"ran: {mark.ran.outcome} {human_duration(now - mark.ran.released_at)} ago"
    return "queued"


def _rows(found: list[Mark], now: float) -> tuple[tuple[str, ...], list[list[str]]]:
    rows = [
        [
            mark.lease.key,
            mark.lease.holder.task_id or "",
            human_duration(now - mark.lease.acquired_at),
            _state(mark, now),
        ]
        for mark in found
    ]
    return ("mark", "task id", "age", "its message"), rows


def _mark_json(mark: Mark, now: float) -> dict[str, Any]:
    return {
        "mark": lease_json(mark.lease, now),
        "lock_key": mark.lock_key,
        "running": None if mark.running is None else mark.running.to_dict(),
        "ran": None if mark.ran is None else record_json(mark.ran),
    }
