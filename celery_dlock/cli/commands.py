"""The commands that read and change locks: ``leases``, ``history``, ``release``, ``reap``,
``migrate``. (``doctor`` has its own module.)

Keys are given in full, exactly as ``leases`` and ``history`` print them
(``job:order:42``); the namespace is not added. A key that is not found but exists under
the namespace gets a hint.
"""

from __future__ import annotations

import functools
import getpass
import os
import socket
from collections.abc import Callable
from typing import NoReturn

import click

from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.common import store_now
from celery_dlock.cli.env import Env, UsageFailure, guarded
from celery_dlock.cli.render import (
    MOST,
    PROBLEM_OUTCOMES,
    SINCE,
    expires_text,
    holder_text,
    human_duration,
    lease_json,
    lease_lines,
    local_time,
    record_json,
    table,
    with_metadata,
)
from celery_dlock.keys import slot_of, validate_key
from celery_dlock.records import Lease, Outcome, Record

__all__ = [
    "COMMANDS", "JSON", "PROBLEM_OUTCOMES", "RECENT", "confirmed", "operator", "records_of",
]  # fmt: skip

#: ``--json`` on every command.
JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON (stable keys) for scripts.")


def _key_hint(env: Env, key: str, *, history: bool = False) -> str:
    """A hint when ``key`` is held in slots (``lock_limit``: busy tasks log the key, not
    the slot), or lacks the namespace and the full key has a lease (or, for ``history``,
    records)."""
    held = [] if history else env.backend.leases(f"{key}#")
    slots = [lease.key for lease in held if slot_of(lease.key, key)]
    if slots:
        return (
            f" (a key with a limit: its slots {', '.join(slots)} are held, each by its own lease)"
        )
    prefix = env.target.prefix
    if prefix and not key.startswith(prefix):
        full = prefix + key
        found = (history and env.backend.history(key=full, limit=1)) or env.backend.get(full)
        if found:
            return f" (keys are given in full: did you mean {full!r}?)"
    return _prefix_hint(env, key) if history else ""


def _prefix_hint(env: Env, key: str) -> str:
    """A hint when ``--key`` was meant as a prefix: keys of the newest records start with it."""
    started = sorted({r.key for r in env.backend.history(limit=RECENT) if r.key.startswith(key)})
    if not started:
        return ""
    shown = ", ".join(started[:3]) + (", ..." if len(started) > 3 else "")
    return (
        f" (--key is one key in full; {len(started)} keys of the newest records start with "
        f"it: {shown}; `timeline --key {key}` shows them together)"
    )


# -- leases ---------------------------------------------------------------------------------


@click.command()
@click.argument("prefix", required=False)
@click.option("--all", "all_keys", is_flag=True, help="Every key, whatever its namespace.")
@JSON
@guarded
def leases(env: Env, prefix: str | None, all_keys: bool, as_json: bool) -> None:
    """List current leases.

    Shows the leases whose key starts with PREFIX (default: the namespace, 'job:'): key,
    holder, age, fence, expires (in N s / never / EXPIRED). A holder marked [gone]
    (process ended) is a process of this host that no longer exists; [gone] (lock session
    ended), on PostgreSQL, one of any host whose lock session ended: `reap` clears its lease
    (where leases live by their ttl, as on Redis, once it expires). [queued message] marks
    a dedupe mark, held for its message until its ttl whatever became of its producer.
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
        full = env.target.prefix + chosen
        if prefix and not chosen.startswith(env.target.prefix) and env.backend.leases(full):
            more = f" (keys are given in full: did you mean {full!r}?)"
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


#: ``history --key K`` looks for K's slots until this many in a row have neither a record
#: nor a lease, past the last slot held now or seen in the newest :data:`RECENT` records:
#: slots are taken in a random order, so a later slot may have records where an earlier one
#: has none. A key with runs of its own and no slot held or seen is not looked through: a
#: plain key's history then costs one query, not four (each a scan of the stream on Redis).
SLOT_GAP = 3
RECENT = 1000


def _slots_in_use(backend: LockBackend, key: str, *, plain: bool) -> list[str]:
    """The slots of ``key`` (``key#0``, ``key#1``, ...) that have records or a lease, asked
    one slot at a time (the stores filter history by exact key only; an indexed lookup on
    Postgres); none for a ``plain`` key (it has runs of its own) without a slot held or
    seen."""
    held = {lease.key for lease in backend.leases(f"{key}#") if slot_of(lease.key, key)}
    seen = {record.key for record in backend.history(limit=RECENT) if slot_of(record.key, key)}
    if plain and not held and not seen:
        return []
    last = max((int(slot[len(key) + 1 :]) for slot in held | seen), default=-1)
    found: list[str] = []
    number = unused = 0
    while unused < SLOT_GAP or number <= last:
        slot = f"{key}#{number}"
        used = slot in held or slot in seen or bool(backend.history(key=slot, limit=1))
        found += [slot] if used else []
        unused = 0 if used else unused + 1
        number += 1
    return found


def records_of(
    backend: LockBackend,
    key: str | None,
    query: Callable[..., list[Record]],
    *,
    limit: int,
) -> tuple[list[Record], list[str]]:
    """The records ``query`` matches for ``key`` (every key: None), and the slots searched:
    a key taken with a limit has its slots' records with its own (a run that found every
    slot busy and was skipped is recorded on the key itself), newest first."""
    records = query(key=key)
    if key is None:
        return records, []
    # A slot's own runs are on the slot; the key itself has only skips (fence 0) of runs
    # that found every slot busy.
    slots = _slots_in_use(backend, key, plain=any(record.fence > 0 for record in records))
    found = records + [record for slot in slots for record in query(key=slot)]
    found.sort(key=lambda record: record.released_at, reverse=True)
    return found[:limit], slots


@click.command()
@click.argument("given", metavar="[KEY]", required=False)
@click.option("--key", help="Only this key (in full, as `leases` shows it); or give it as KEY.")
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
    given: str | None,
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
    KEY (or --key) with no records of its own that was taken with a limit shows its slots'
    records (KEY#0, KEY#1, ...), and says so.
    """
    if given is not None and key is not None and given != key:
        raise UsageFailure(f"two keys given, {given!r} and --key {key!r}: give one")
    key = given if key is None else key
    if key is not None:
        validate_key(key)
    kind = None if outcome is None else Outcome(outcome)
    if problems and kind is not None and kind not in PROBLEM_OUTCOMES:  # would match nothing
        shown = ", ".join(o.value for o in PROBLEM_OUTCOMES)
        raise UsageFailure(f"--outcome {outcome} is not a problem: --problems shows {shown}")
    query = functools.partial(
        query_history, env.backend, outcome=kind, problems=problems, since=since, limit=limit
    )
    records, slots = records_of(env.backend, key, query, limit=limit)
    if as_json:
        found = [record_json(record) for record in records]
        env.emit_json({"backend": env.url, "records": found, "slots": slots})
        return
    if slots:
        shown = "with the records of" if records else "no record matches in it or in"
        text = f"{key} is a key taken with a limit: {shown} its slots"
        env.echo(f"{text} {', '.join(slots)}", err=True)
    if not records:
        hint = "" if key is None or slots else _key_hint(env, key, history=True)
        env.echo(f"no history records match in {env.url}{hint}")
        return
    _show_records(env, records, details=details)


def _show_records(env: Env, records: list[Record], *, details: bool) -> None:
    """The records as a table, each followed by its details when asked for."""
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
    """``user@host`` of whoever runs the command, for the record of what it did."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for our uid (a bare container)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


@click.command()
@click.argument("key")
@click.option("--force", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--fence",
    type=click.IntRange(min=0),
    help="Only the lease with this fence (as `leases` showed it): a lease taken since, by a "
    "live holder, is left alone.",
)
@click.option("--reason", default="no reason given", show_default=True, help="Kept in the record.")
@JSON
@guarded
def release(
    env: Env, key: str, *, force: bool, fence: int | None, reason: str, as_json: bool
) -> None:
    """Release the lease on KEY, recorded as forced.

    KEY is the full key, as `leases` shows it. Shows the lease and asks first, unless
    --force. Only the lease shown is released, by its token: if it ends or changes hands
    meanwhile, nothing is touched. With --fence, only a lease with that fence is released
    (for scripts that chose it from `leases --json`). Exit code 0 only when this command
    released the lease.
    """
    validate_key(key)
    backend = env.backend
    lease = backend.get(key)
    now = store_now(backend)
    if lease is None:
        _finish(env, as_json, key, "not_held", f"no lease on {key!r}{_key_hint(env, key)}")
    if fence is not None and lease.fence != fence:
        text = (
            f"not released: the lease on {key} has fence {lease.fence}, not {fence} "
            f"({lease.holder.describe()}); it was left untouched"
        )
        _finish(env, as_json, key, "changed", text, current=lease)
    env.echo(f"lease on {key}:\n{lease_lines(lease, now)}", err=as_json)
    question = f"Release it (fence {lease.fence}), recorded as forced?"
    if not force and not confirmed(env, question, err=as_json):
        _finish(env, as_json, key, "declined", "not released", shown=lease)
    details = f"released by {operator()} with celery-dlock release: {reason}"
    record = backend.release(lease, Outcome.FORCED, "forced", details)
    if record is not None:
        text = f"released {key} (fence {lease.fence}); recorded as forced: {reason}"
        _finish(env, as_json, key, "released", text, shown=lease, record=record)
    _not_released(env, as_json, lease)


def confirmed(env: Env, question: str, *, err: bool) -> bool:
    """The operator's answer; none (stdin closed: cron, a script) is a no, reported as such
    (click's Abort printed no JSON); Ctrl-C is a KeyboardInterrupt again: exit 130, not 1."""
    try:
        return click.confirm(question, default=False, err=err)
    except click.Abort as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):  # click raises Abort from None
            raise KeyboardInterrupt from None
        env.echo(err=err)  # end the question's line
        return False


def _not_released(env: Env, as_json: bool, lease: Lease) -> NoReturn:
    """Say why ``lease`` was not released: it ended, or another is on its key now."""
    key = lease.key
    current = env.backend.get(key)
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


COMMANDS = (leases, history, release)
