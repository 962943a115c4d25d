"""The commands that read and change locks: ``leases``, ``history``, ``release``, ``reap``,
``migrate``. (``doctor`` has its own module.)

Keys are given in full, exactly as ``leases`` and ``history`` print them
(``job:order:42``); the namespace is not added. A key that is not found but exists under
the namespace gets a hint.
"""

from __future__ import annotations

import getpass
import math
import os
import socket
import time
from typing import Any, NoReturn

import click

from celery_dlock.backends.base import LockBackend, server_time
from celery_dlock.cli.env import Env, UsageFailure, guarded
from celery_dlock.cli.render import (
    DURATION,
    MOST,
    PROBLEM_OUTCOMES,
    SINCE,
    expires_text,
    holder_text,
    human_duration,
    lease_json,
    local_time,
    record_json,
    table,
    with_metadata,
)
from celery_dlock.keys import validate_key
from celery_dlock.reap import reap as janitor_reap
from celery_dlock.records import Lease, Outcome, Record

__all__ = ["COMMANDS", "JSON", "PROBLEM_OUTCOMES", "store_now"]

#: ``--json`` on every command.
JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys) for scripts.")

#: The outcomes ``history --problems`` shows: a lease that did not end the ordinary way.


def store_now(backend: LockBackend) -> float:
    """Now, on the store's clock where it has one (leases carry the store's times)."""
    server = server_time(backend)
    return time.time() if server is None else server


def _key_hint(env: Env, key: str, *, history: bool = False) -> str:
    """A hint when ``key`` is held in slots (``lock_limit``: busy tasks log the key, not
    the slot), or lacks the namespace and the full key has a lease (or, for ``history``,
    records)."""
    held = [] if history else env.backend.leases(f"{key}#")
    slots = [lease.key for lease in held if _slot_of(lease.key, key)]
    if slots:
        return (
            f" (a key with a limit: its slots {', '.join(slots)} are held, each by its own lease)"
        )
    prefix = env.target.prefix
    if not prefix or key.startswith(prefix):
        return ""
    full = prefix + key
    found = (history and env.backend.history(key=full, limit=1)) or env.backend.get(full)
    return f" (keys are given in full: did you mean {full!r}?)" if found else ""


def _slot_of(slot: str, key: str) -> bool:
    """Whether ``slot`` is one of ``key``'s slots (``key#0``, ``key#1``, ...)."""
    return slot.startswith(f"{key}#") and slot[len(key) + 1 :].isdigit()


# -- leases ---------------------------------------------------------------------------------


@click.command()
@click.argument("prefix", required=False)
@click.option("--all", "all_keys", is_flag=True, help="Every key, whatever its namespace.")
@JSON
@guarded
def leases(env: Env, prefix: str | None, all_keys: bool, as_json: bool) -> None:
    """List current leases.

    Shows the leases whose key starts with PREFIX (default: the namespace, 'job:'): key,
    holder, age, fence, expires (in N s / never / EXPIRED). A holder marked [gone] is a
    process of this host that no longer exists: `reap` clears its lease.
    """
    if prefix is not None and all_keys:
        raise UsageFailure("give a PREFIX or --all, not both")
    chosen = "" if all_keys else env.target.prefix if prefix is None else prefix
    found = env.backend.leases(chosen)
    now = store_now(env.backend)
    if as_json:
        env.emit_json(
            {
                "backend": env.url,
                "prefix": chosen,
                "now": now,
                "leases": [lease_json(lease, now) for lease in found],
            }
        )
        return
    if not found:
        where = f"under {chosen!r} " if chosen else ""
        more = " (--all for every key)" if chosen and prefix is None else ""
        env.echo(f"no leases {where}in {env.url}{more}")
        return
    rows = [
        [
            lease.key,
            holder_text(lease),
            human_duration(now - lease.acquired_at),
            str(lease.fence),
            expires_text(lease, now),
        ]
        for lease in found
    ]
    env.echo(table(*with_metadata(("key", "holder", "age", "fence", "expires"), rows, found)))


# -- history --------------------------------------------------------------------------------


def query_history(
    backend: LockBackend,
    *,
    key: str | None,
    outcome: Outcome | None,
    problems: bool,
    since: float | None,
    limit: int,
) -> list[Record]:
    """Records newest first; ``problems`` keeps the outcomes of :data:`PROBLEM_OUTCOMES`,
    asked of the store one outcome at a time so that ``limit`` counts problems only."""
    if not problems:
        return backend.history(key=key, outcome=outcome, since=since, limit=limit)
    wanted = [o for o in PROBLEM_OUTCOMES if outcome is None or o is outcome]
    found = [
        record
        for kind in wanted
        for record in backend.history(key=key, outcome=kind, since=since, limit=limit)
    ]
    found.sort(key=lambda record: record.released_at, reverse=True)
    return found[:limit]


@click.command()
@click.option("--key", help="Only this key (in full, as `leases` shows it).")
@click.option("--outcome", type=click.Choice([o.value for o in Outcome]), help="Only this outcome.")
@click.option(
    "--problems",
    is_flag=True,
    help="Only leases that did not end the ordinary way: "
    + ", ".join(o.value for o in PROBLEM_OUTCOMES)
    + ".",
)
@click.option("--since", type=SINCE, help="Released since: a duration back (10m, 2h) or ISO time.")
@click.option("--limit", type=click.IntRange(min=1, max=MOST), default=50, show_default=True)
@click.option("--details", is_flag=True, help="Show each record's details (message, traceback).")
@JSON
@guarded
def history(
    env: Env,
    *,
    key: str | None,
    outcome: str | None,
    problems: bool,
    since: float | None,
    limit: int,
    details: bool,
    as_json: bool,
) -> None:
    """Show released leases, newest first.

    Columns: released (local time), key, outcome, problem, fence, holder, duration held.
    """
    if key is not None:
        validate_key(key)
    kind = None if outcome is None else Outcome(outcome)
    records = query_history(
        env.backend, key=key, outcome=kind, problems=problems, since=since, limit=limit
    )
    if as_json:
        env.emit_json({"backend": env.url, "records": [record_json(r) for r in records]})
        return
    if not records:
        hint = "" if key is None else _key_hint(env, key, history=True)
        env.echo(f"no history records match in {env.url}{hint}")
        return
    rows = [
        [
            local_time(record.released_at),
            record.key,
            record.outcome.value,
            record.problem or "-",
            str(record.fence) if record.fence else "-",
            record.lease.holder.describe(),
            human_duration(record.released_at - record.lease.acquired_at),
        ]
        for record in records
    ]
    headers = ("released", "key", "outcome", "problem", "fence", "holder", "duration")
    held = [record.lease for record in records]
    lines = table(*with_metadata(headers, rows, held)).split("\n")
    if not details:
        env.echo("\n".join(lines))
        return
    env.echo(lines[0])
    for line, record in zip(lines[1:], records, strict=True):
        env.echo(line)
        for text in (record.details or "(no details)").splitlines():
            env.echo(f"    {text}")


# -- release --------------------------------------------------------------------------------


def operator() -> str:
    """``user@host`` of whoever runs the command, for the record of a forced release."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for our uid (a bare container)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def _lease_lines(lease: Lease, now: float) -> str:
    rows = [
        ["key", lease.key],
        ["holder", holder_text(lease)],
        ["fence", str(lease.fence)],
        [
            "acquired",
            f"{local_time(lease.acquired_at)} ({human_duration(now - lease.acquired_at)} ago)",
        ],
        ["expires", expires_text(lease, now)],
    ]
    return "\n".join(f"  {name:<9}{value}" for name, value in rows)


@click.command()
@click.argument("key")
@click.option("--force", is_flag=True, help="Do not ask for confirmation.")
@click.option("--reason", default="no reason given", show_default=True, help="Kept in the record.")
@JSON
@guarded
def release(env: Env, key: str, force: bool, reason: str, as_json: bool) -> None:
    """Release the lease on KEY, recorded as forced.

    KEY is the full key, as `leases` shows it. Shows the lease and asks first, unless
    --force. Only the lease shown is released, by its token: if it ends or changes hands
    meanwhile, nothing is touched. Exit code 0 only when this command released the lease.
    """
    validate_key(key)
    backend = env.backend
    lease = backend.get(key)
    now = store_now(backend)
    if lease is None:
        _finish(env, as_json, key, "not_held", f"no lease on {key!r}{_key_hint(env, key)}")
    env.echo(f"lease on {key}:\n{_lease_lines(lease, now)}", err=as_json)
    question = f"Release it (fence {lease.fence}), recorded as forced?"
    if not force and not click.confirm(question, default=False, err=as_json):
        _finish(env, as_json, key, "declined", "not released", shown=lease)
    details = f"released by {operator()} with celery-dlock release: {reason}"
    record = backend.release(lease, Outcome.FORCED, "forced", details)
    if record is not None:
        text = f"released {key} (fence {lease.fence}); recorded as forced: {reason}"
        _finish(env, as_json, key, "released", text, shown=lease, record=record)
    current = backend.get(key)
    if current is None:
        text = (
            f"not released: the lease on {key} (fence {lease.fence}) ended before it could "
            "be released (its holder released it, or it expired); nothing was touched"
        )
        _finish(env, as_json, key, "ended", text, shown=lease)
    text = (
        f"not released: {key} changed hands meanwhile; the new lease (fence {current.fence}, "
        f"{current.holder.describe()}) was left untouched"
    )
    _finish(env, as_json, key, "changed", text, shown=lease, current=current)


def _finish(
    env: Env,
    as_json: bool,
    key: str,
    status: str,
    text: str,
    *,
    shown: Lease | None = None,
    record: Record | None = None,
    current: Lease | None = None,
) -> NoReturn:
    """Report how ``release`` ended and exit: 0 when released, else 1."""
    released = status == "released"
    if as_json:
        env.emit_json(
            {
                "backend": env.url,
                "key": key,
                "status": status,
                "released": released,
                "lease": None if shown is None else shown.to_dict(),
                "record": None if record is None else record_json(record),
                "current": None if current is None else current.to_dict(),
            }
        )
    else:
        env.echo(text, err=not released)
    click.get_current_context().exit(0 if released else 1)


# -- reap, migrate --------------------------------------------------------------------------


@click.command()
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=MOST),
    default=1000,
    show_default=True,
    help="Most leases to clear.",
)
@click.option(
    "--retention",
    type=DURATION,
    help="Also delete history older than this (under Celery: dlock_history_retention).",
)
@JSON
@guarded
def reap(env: Env, limit: int, retention: float | None, as_json: bool) -> None:
    """Run the janitor once.

    Clears leases whose holder is gone or whose time ran out (recorded as disconnected or
    expired) and, with a retention, prunes older history.
    """
    if retention is None:
        retention = env.target.retention
    batch = min(limit, 100)
    counts = janitor_reap(
        env.backend,
        namespace=env.target.namespace,
        retention=retention,
        batch=batch,
        max_batches=math.ceil(limit / batch),
    )
    if as_json:
        env.emit_json({"backend": env.url, "retention": retention, **counts})
    elif counts["skipped"]:
        env.echo("another janitor is running now: nothing done")
    else:
        pruned = "not pruned" if retention is None else f"{counts['pruned']} records pruned"
        env.echo(
            f"leases reaped: {counts['reaped']} ({counts['disconnected']} disconnected, "
            f"{counts['expired']} expired); history {pruned}"
        )


@click.command()
@JSON
@guarded
def migrate(env: Env, as_json: bool) -> None:
    """Create the store's tables if missing.

    Idempotent; stores without a schema (file, redis, object stores) need none.
    """
    backend = env.backend
    run: Any = getattr(backend, "migrate", None)
    if run is not None:
        run()
    if as_json:
        env.emit_json({"backend": env.url, "store": backend.name, "migrated": run is not None})
    elif run is None:
        env.echo(f"the {backend.name} backend needs no migration")
    else:
        env.echo(f"the {backend.name} schema is up to date in {env.url}")


COMMANDS = (leases, history, release, reap, migrate)
