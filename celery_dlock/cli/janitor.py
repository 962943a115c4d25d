"""``reap`` and ``migrate``: the janitor once, and the store's schema."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from celery_dlock.cli.commands import JSON
from celery_dlock.cli.env import Env, guarded, guarded_creating
from celery_dlock.cli.render import DURATION, MOST, record_json
from celery_dlock.reap import logger as janitor_logger
from celery_dlock.reap import reap as janitor_reap
from celery_dlock.records import Record

__all__ = ["migrate", "reap"]

#: Cleared leases printed one per line; ``--json`` has them all.
SHOWN = 20


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
    expired) and, with a retention, prunes older history. Prints each lease it cleared (the
    first 20; --json lists every one under "cleared").
    """
    if retention is None:
        retention = env.target.retention
    batch = min(limit, 100)
    cleared: list[Record] = []
    with _quiet(janitor_logger):  # this command prints what it cleared, once
        counts = janitor_reap(
            env.backend,
            namespace=env.target.namespace,
            retention=retention,
            batch=batch,
            max_batches=math.ceil(limit / batch),
            cleared=cleared.append,
            limit=limit,
        )
    if as_json:
        found = {"backend": env.url, "retention": retention, **counts}
        env.emit_json({**found, "cleared": [record_json(record) for record in cleared]})
        return
    if counts["skipped"]:
        env.echo("another janitor is running now: nothing done")
        return
    for record in cleared[:SHOWN]:
        env.echo(
            f"cleared {record.key} (fence {record.fence}, "
            f"{record.lease.holder.describe()}): {record.outcome.value}"
        )
    if len(cleared) > SHOWN:
        env.echo(f"... and {len(cleared) - SHOWN} more (--json lists every one)")
    pruned = "not pruned" if retention is None else f"{counts['pruned']} records pruned"
    env.echo(
        f"leases reaped: {counts['reaped']} ({counts['disconnected']} disconnected, "
        f"{counts['expired']} expired); history {pruned}"
    )


@contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """``logger`` off for a while: with no handler set up, each of its lines would reach
    stderr bare, one per cleared lease."""
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


@click.command()
@JSON
@guarded_creating
def migrate(env: Env, as_json: bool) -> None:
    """Create the store's tables if missing.

    Idempotent; stores without a schema (file, redis, object stores) need none.
    """
    backend = env.backend
    run: Any = getattr(backend, "migrate", None)
    done = None if run is None else run()
    if as_json:
        found = {"backend": env.url, "store": backend.name, "migrated": run is not None}
        env.emit_json({**found, "done": done})
    elif run is None:
        env.echo(f"the {backend.name} backend needs no migration")
    else:
        env.echo(f"the {backend.name} schema in {env.url}: {done or 'up to date'}")
