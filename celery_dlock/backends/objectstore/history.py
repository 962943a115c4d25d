"""History as create-only objects: one per record under ``history/``, named so that a
listing is newest first and filters by key and outcome without reading bodies; the answers
of ``once`` under ``success/`` (see ``layout.py``).

Functions of the backend whose history they keep (``ObjectStoreBackend`` delegates here).
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any

from celery_dlock.backends.base import success_task
from celery_dlock.backends.naming import file_name
from celery_dlock.backends.objectstore.clock import ServerNow
from celery_dlock.backends.objectstore.layout import (
    LockState,
    Successes,
    encode,
    keeps_result,
    kept_in,
    us,
    with_success,
)
from celery_dlock.errors import BackendError
from celery_dlock.events import fields
from celery_dlock.records import Lease, Outcome, Record

if TYPE_CHECKING:
    from celery_dlock.backends.objectstore import ObjectStoreBackend

__all__ = [
    "add",
    "ending",
    "flush",
    "forget",
    "keep",
    "landed",
    "last_success",
    "prune",
    "query",
    "released_at",
    "remember",
    "succeed",
]

logger = logging.getLogger("celery_dlock")
_MICRO = 1e6


def flush(
    backend: ObjectStoreBackend,
    record: dict[str, Any],
    successes: Successes | None = None,
    *,
    history: bool = True,
) -> None:
    """Write ``record`` (a ``Record.to_dict()``) to ``history/``, and to ``success/`` if it
    is the success kept for its task in ``successes`` (its lock object's); create-if-absent,
    so writing twice is harmless. A failure is logged: the record stays in its lock object
    (``ended``) until ``keep`` or ``reap`` copies it."""
    try:
        _write(backend, record, successes, history=history)
    except BackendError as exc:
        extra = fields("history_delayed", key=record["lease"]["key"], backend=backend.url)
        logger.warning("record of %s not yet in history: %s", extra["key"], exc, extra=extra)


def keep(backend: ObjectStoreBackend, state: LockState) -> None:
    """Make sure ``state.ended``, about to be replaced in its lock object, is in
    ``history/`` first: its writer may have died, or failed to write it, after the swap
    that put it there. One create-if-absent unless this process wrote it already.

    Raises:
        BackendError: it could not be written; the swap that would replace it must not be
            made.
    """
    assert state.ended is not None
    _write(backend, state.ended, state.successes, history=True)


def _write(
    backend: ObjectStoreBackend,
    record: dict[str, Any],
    successes: Successes | None,
    *,
    history: bool,
) -> None:
    local = backend.objects.local.get()
    token = str(record["lease"]["token"])
    if local.flushed(token):
        return
    names = [backend.layout.history_name(record)] if history else []
    if kept_in(successes, record):
        lease = record["lease"]
        names.append(backend.layout.success_name(lease["key"], str(lease["holder"]["task_name"])))
    body = encode(record)
    for name in names:
        backend.objects.create(name, body)
    if history:
        local.mark_flushed(token)


def add(backend: ObjectStoreBackend, record: Record) -> None:
    """A record that ended no lease here (a skipped attempt): history, and ``success/`` if
    it answers ``once`` and no success of its key and task is kept (``remember``)."""
    data = record.to_dict()
    backend.objects.create(backend.layout.history_name(data), encode(data))
    if keeps_result(data):
        remember(backend, record)


def query(
    backend: ObjectStoreBackend,
    key: str | None,
    outcome: Outcome | None,
    since: float | None,
    limit: int | None,
) -> list[Record]:
    """Records newest first: names are listed in order, filtered by name, and only the
    bodies of records kept are read."""
    layout = backend.layout
    wanted = None if outcome is None else Outcome(outcome).value
    key_name = None if key is None else file_name(key)
    oldest = None if since is None else math.floor(since * _MICRO)
    found: list[Record] = []
    for name in backend.store().names(layout.history):
        if limit is not None and len(found) >= limit:
            break
        parsed = layout.parse_history(name)
        if parsed is None:
            continue
        if oldest is not None and parsed.micros < oldest:
            break  # newest first: the rest are older still
        if (wanted is not None and parsed.outcome != wanted) or (
            key_name is not None and parsed.key_name != key_name
        ):
            continue
        body = backend.objects.read(name).body
        if body is None:
            continue  # pruned meanwhile
        record = Record.from_dict(json.loads(body))
        if (key is None or record.key == key) and (since is None or record.released_at >= since):
            found.append(record)
    return found


def landed(
    backend: ObjectStoreBackend, lease: Lease, outcome: Outcome, state: LockState | None
) -> Record | None:
    """The record of ``lease``'s release with ``outcome`` if an earlier try of that release
    landed though its answer was lost, the key perhaps taken since (``state``: its lock
    object now): in the lock object's ``ended``, or under ``history/`` once a later writer
    moved it there (found by name among those released since the lease was granted).
    None: no such release landed."""
    wanted = Outcome(outcome).value
    ended = None if state is None else state.ended
    if state is not None and ended is not None and ended["lease"]["token"] == lease.token:
        if ended["outcome"] != wanted:
            return None
        flush(backend, ended, state.successes)
        return Record.from_dict(ended)
    oldest = math.floor(lease.acquired_at * _MICRO)
    for found in backend.store().names(backend.layout.history):
        parsed = backend.layout.parse_history(found)
        if parsed is None:
            continue
        if parsed.micros < oldest:
            break  # newest first: the rest were released before the lease was granted
        if parsed.token == lease.token and parsed.outcome == wanted:
            body = backend.objects.read(found).body
            return None if body is None else Record.from_dict(json.loads(body))
    return None


def last_success(backend: ObjectStoreBackend, key: str, task_name: str) -> Record | None:
    """From the lock object (one read), else from its ``success/`` object (one more)."""
    name = backend.layout.lock(key)
    state = backend.objects.decode(backend.objects.read(name), name)
    if state is not None and task_name in state.successes:
        return Record.from_dict(state.successes[task_name])
    body = backend.objects.read(backend.layout.success_name(key, task_name)).body
    return None if body is None else Record.from_dict(json.loads(body))


def succeed(backend: ObjectStoreBackend, state: LockState, record: dict[str, Any]) -> Successes:
    """``state``'s successes after the release that writes ``record``, made before its swap.

    The first success of a task in the lock object is first created under ``success/``
    (create-if-absent, one request, which ``flush`` then need not make): if another's is
    there (a ``remember`` of a lost lease, a success collected or crowded out of the lock
    object), that one is kept, and the lock object keeps it too. The first success wins."""
    if not keeps_result(record):
        return state.successes
    task_name = str(record["lease"]["holder"]["task_name"])
    kept = state.successes.get(task_name)
    if kept is None:
        kept = _first(backend, state.key, task_name, record)
        if kept["lease"]["token"] != record["lease"]["token"]:
            return with_success(state.successes, kept)
    if kept["lease"]["token"] != record["lease"]["token"]:
        return state.successes
    return with_success(state.successes, record)


#: Creates of a ``success/`` object tried, each refused by one deleted before its read.
_FIRST_ATTEMPTS = 4


def _first(
    backend: ObjectStoreBackend, key: str, task_name: str, record: dict[str, Any]
) -> dict[str, Any]:
    """The success kept under ``success/`` for ``key`` and ``task_name``: ``record`` if
    its create-if-absent is the first, else the one there (ours too, if an earlier try of
    the same release made it)."""
    name = backend.layout.success_name(key, task_name)
    for _ in range(_FIRST_ATTEMPTS):
        if backend.objects.create(name, encode(record)).version is not None:
            return record
        body = backend.objects.read(name).body
        if body is not None:
            kept: dict[str, Any] = json.loads(body)
            return kept
        # Gone between the refused create and the read: forgotten (``forget``), or deleted
        # by hand. Nothing is kept now: create it again.
    raise BackendError(f"{name!r} was there, then gone, {_FIRST_ATTEMPTS} times", backend.url)


def remember(backend: ObjectStoreBackend, record: Record) -> bool:
    """``record`` under ``success/`` unless another lease's success of its key and task is
    kept already: one create-if-absent, as a release makes before the swap that would keep
    its own (so a success in a lock object is under ``success/`` too); the first to create
    it wins. The lease's own (by token) is swapped for ``record``."""
    task_name = success_task(record)
    name = backend.layout.success_name(record.key, task_name)
    body = encode(record.to_dict())
    if backend.objects.create(name, body).version is not None:
        return True
    found = backend.objects.read(name)
    kept = None if found.body is None else Record.from_dict(json.loads(found.body))
    if kept is None or found.version is None or kept.lease.token != record.lease.token:
        return False
    version, _ = backend.objects.put(name, body, found.version, "remember")
    return version is not None


#: Swaps of a lock object tried to forget a success, against writes racing them.
_FORGET_ATTEMPTS = 8


def forget(backend: ObjectStoreBackend, key: str, task_name: str, token: str) -> bool:
    """Forget the success of ``task_name`` on ``key`` kept by the lease with ``token``:
    its ``success/`` object (a delete by version), then out of the lock object's
    ``successes`` (a compare-and-swap that carries the rest, a lease held included).
    Whether this call forgot it: its delete of the ``success/`` object, where every kept
    success is (``layout``), decides between forgets racing.

    In that order, and the lock object swapped after a delete even without the success in
    it, because a release whose lock object lacks the task's success copies the one under
    ``success/`` into it (``succeed``): deleted second, the success forgotten would come
    back through a release landing between the two writes; and a release that read the
    ``success/`` object before the delete fails its swap on the version this swap changed,
    and reads again.

    Raises:
        BackendError: the lock object changed under every swap tried.
    """
    store = backend.store()
    forgotten = False
    for success in list(store.names(backend.layout.success_dir(key, task_name))):
        found = backend.objects.read(success)
        if found.body is None or found.version is None:
            continue
        if Record.from_dict(json.loads(found.body)).lease.token == token:
            forgotten = store.delete_if(success, found.version) or forgotten
    name = backend.layout.lock(key)
    for _ in range(_FORGET_ATTEMPTS):
        state = backend.objects.decode(backend.objects.read(name), name)
        kept = None if state is None else state.successes.get(task_name)
        ours = kept is not None and kept["lease"]["token"] == token
        if state is None or not (ours or forgotten):
            return forgotten
        rest = {
            task: record
            for task, record in state.successes.items()
            if not ours or task != task_name
        }
        written, _ = backend.objects.write_state(
            name, state, state.key, state.fence, state.lease, freed_at=state.freed_at,
            successes=rest,
        )  # fmt: skip
        if written is not None:
            return forgotten
    raise BackendError(f"{name!r} changed under every try to forget a success", backend.url)


def prune(backend: ObjectStoreBackend, before: float) -> int:
    """Delete history objects released before ``before`` (listed from that point on, as
    names sort newest first) and superseded ``success/`` objects; returns the records.
    Nothing was released before 1970: such a ``before`` (whose name would sort before every
    history name) prunes nothing."""
    if before <= 0:
        return 0
    store = backend.store()
    layout = backend.layout
    pruned = 0
    start = layout.history_before(math.ceil(before * _MICRO))
    for name in list(store.names(layout.history, start_after=start)):
        store.delete(name)
        pruned += 1
    kept: set[str] = set()
    for name in list(store.names(layout.success)):
        directory = name.rpartition("/")[0]
        if directory in kept:
            store.delete(name)
        else:
            kept.add(directory)
    return pruned


def released_at(lease: Lease, now: ServerNow) -> float:
    return us(max(now.low, lease.acquired_at))


def ending(
    lease: Lease,
    now: ServerNow,
    outcome: Outcome,
    *,
    problem: str | None = None,
    details: str | None = None,
    result: Any = None,
) -> Record:
    """The record of ``lease`` ending now (by the server's clock)."""
    return Record(lease, released_at(lease, now), Outcome(outcome), problem, details, result)
