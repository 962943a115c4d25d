"""The app of tests/celery/test_replace_trial.py's prefork worker: ``LockedTask`` bodies that
hand their run to a replacement (``Task.replace``): a chain, a group, themselves (page by
page), from several keys, from a key's slots, around retries, with a busy key.

Configured by environment as ``workerapp`` is (:func:`tests.support.workerapps.worker_app`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

if not __package__:
    # A top-level module of a worker run in tests/celery: the tree's root goes first on
    # sys.path, as pytest's `pythonpath = ["."]` puts it, for `tests.support`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from celery import chain, group

from celery_dlock import LockedTask
from tests.support.workerapps import ledger, locked_task, worker_app, write_event

app = worker_app("replace_trial_app")


class SlowHandOver(LockedTask):
    """A task whose own ``on_replace`` does some work after Celery's (a log, a metric):
    half a second between the replacement's sending and the end of the run."""

    abstract = True

    def on_replace(self, sig: Any) -> Any:
        try:
            return super().on_replace(sig)
        finally:
            time.sleep(0.5)


@app.task(shared=False, bind=True, name="r.note")
def note(self: Any, order: str, tag: str) -> str:
    """The effect a replacement has: one event, the tag and order back."""
    write_event("note", self, key=None, order=order, tag=tag)
    return f"{tag} {order}"


@locked_task(app, "r.chained", lock_key="chained:{order}", once=True)
def chained(self: Any, order: str, step: int = 0) -> Any:
    """Step 0 hands its run to a chain whose middle step is this task on the same key."""
    ledger("start", self, step=step)
    ledger("end", self, step=step)
    if step == 0:
        return self.replace(chain(note.si(order, "a"), chained.si(order, 1), note.si(order, "b")))
    return f"step {step}"


@locked_task(app, "r.fanout", lock_key="fanout:{order}", once=True)
def fanout(self: Any, order: str) -> Any:
    """Hands its run to a group (Celery makes it a chord)."""
    ledger("start", self)
    ledger("end", self)
    return self.replace(group(note.si(order, str(n)) for n in range(3)))


@locked_task(app, "r.inchain", lock_key="inchain:{order}", once=True)
def inchain(self: Any, order: str) -> Any:
    """A step of a chain that hands its run to the note ``r``."""
    ledger("start", self)
    ledger("end", self)
    return self.replace(note.si(order, "r"))


@locked_task(app, "r.deep", lock_key="deep:{customer}", once=True)
def deep(self: Any, customer: str, page: int, last: int, *, pause: float, later: float) -> Any:
    """One page, then the next page's run on the same key, sent ``later`` seconds on."""
    ledger("start", self, page=page, nesting=self.request.replaced_task_nesting)
    time.sleep(pause)
    ledger("end", self, page=page)
    if page < last:
        nxt = deep.si(customer, page + 1, last, pause=pause, later=later)
        return self.replace(nxt.set(countdown=later) if later else nxt)
    return {"pages": page}


def pages_table() -> tuple[str, str]:
    """The Postgres store's database and, beside its tables, the table of pages written."""
    base, _, query = os.environ["DLOCK_TEST_LOCKS"].partition("?")
    return base, f'"{dict(parse_qsl(query))["schema"]}".trial_pages'


@locked_task(app, "r.booked", lock_key="booked:{customer}", once=True)
def booked(self: Any, customer: str, page: int, last: int, later: float = 0) -> Any:
    """``deep`` whose pages write a row each, in a transaction that keeps the page's
    success (``record_success``; the Postgres store): the last page's result, the others'
    None, before the next page's run replaces them (sent ``later`` seconds on)."""
    import psycopg

    ledger("start", self, page=page)
    url, table = pages_table()
    result = {"pages": page} if page == last else None
    with psycopg.connect(url) as connection:
        connection.execute(f"INSERT INTO {table} VALUES (%s, %s)", (customer, page))
        self.record_success(connection, result)
    ledger("end", self, page=page)
    if page < last:
        nxt = booked.si(customer, page + 1, last, later)
        return self.replace(nxt.set(countdown=later) if later else nxt)
    return result


@locked_task(
    app,
    "r.skipping",
    base=SlowHandOver,
    lock_key="skipping:{customer}",
    once=True,
    on_locked="skip",
)
def skipping(self: Any, customer: str, page: int, last: int) -> Any:
    """``deep`` with ``on_locked="skip"``: a page that finds its key held is skipped."""
    ledger("start", self, page=page)
    ledger("end", self, page=page)
    if page < last:
        return self.replace(skipping.si(customer, page + 1, last))
    return {"pages": page}


@locked_task(app, "r.queued", lock_key="queued:{customer}", once=True, dedupe="until_finished")
def queued(self: Any, customer: str, page: int, last: int, later: float = 0) -> Any:
    """``skipping`` queued under a dedupe mark until it ends; the next page sent ``later``
    seconds on."""
    ledger("start", self, page=page)
    ledger("end", self, page=page)
    if page < last:
        nxt = queued.si(customer, page + 1, last, later)
        return self.replace(nxt.set(countdown=later) if later else nxt)
    return {"pages": page}


@locked_task(app, "r.synced", lock_key="synced:{customer}", dedupe="until_finished")
def synced(self: Any, customer: str, page: int, last: int, pause: float) -> Any:
    """A sync queued under a dedupe mark until it ends, one page per run, each page's run
    replaced by the next's (the same task on the same key)."""
    ledger("start", self, page=page)
    time.sleep(pause)
    ledger("end", self, page=page)
    if page < last:
        return self.replace(synced.si(customer, page + 1, last, pause))
    return {"pages": page}


@locked_task(app, "r.moved", lock_key=["account:{src}", "account:{dst}"])
def moved(self: Any, src: str, dst: str) -> Any:
    """Holds two keys, then hands its run to the note."""
    write_event("start", self, keys=[lease.key for lease in self.leases])
    return self.replace(note.si(src, "moved"))


@locked_task(app, "r.exported", lock_key="export:{tenant}", lock_limit=2)
def exported(self: Any, tenant: str) -> Any:
    """Holds one of two slots, then hands its run to the note."""
    ledger("start", self)
    return self.replace(note.si(tenant, "exported"))


@locked_task(
    app,
    "r.flaky",
    lock_key="flaky:{order}",
    once=True,
    autoretry_for=(ValueError,),
    max_retries=3,
    default_retry_delay=0,
)
def flaky(self: Any, order: str) -> Any:
    """Fails its first attempt (autoretry), then hands its run to the note."""
    ledger("start", self, retries=self.request.retries)
    if self.request.retries == 0:
        raise ValueError("first attempt fails")
    return self.replace(note.si(order, "flaky"))


@locked_task(app, "r.retrying", lock_key="retrying:{order}", once=True, max_retries=3)
def retrying(self: Any, order: str, step: int = 0) -> Any:
    """Step 0 hands its run to step 1 on the same key, which retries once, then returns."""
    ledger("start", self, step=step, retries=self.request.retries)
    if step == 0:
        return self.replace(retrying.si(order, 1))
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return f"done {order}"


# -- tests/celery/test_replace_mark_trial.py ---------------------------------------------


def _page(self: Any, customer: str, page: int, last: int, how: dict[str, Any]) -> Any:
    """One page of a sync, then the next page's run (same task, on the key of ``how["to"]``
    if given, else the same key) with the message options ``how["next"]``. ``how`` also
    says which page fails (``fail``), retries once (``again``, after ``again_in`` s) and
    how long the first page (``first_pause``) and each page after it (``pause``) work."""
    ledger("start", self, page=page, retries=self.request.retries)
    time.sleep(how.get("pause", 0) if page > 1 else how.get("first_pause", 0))
    if page == how.get("fail"):
        raise ValueError(f"page {page} fails")
    if page == how.get("again") and self.request.retries == 0:
        raise self.retry(countdown=how.get("again_in", 0))
    ledger("end", self, page=page)
    if page < last:
        nxt = self.si(how.get("to", customer), page + 1, last, how)
        return self.replace(nxt.set(**how.get("next", {})))
    return {"pages": page}


@locked_task(app, "r.paged", lock_key="paged:{customer}", dedupe="until_finished", max_retries=3)
def paged(self: Any, customer: str, page: int, last: int, how: dict[str, Any]) -> Any:
    """A sync under an ``until_finished`` mark, page by page (:func:`_page`)."""
    return _page(self, customer, page, last, how)


@locked_task(
    app,
    "r.paged_raise",
    lock_key="paged_raise:{customer}",
    dedupe="until_finished",
    on_duplicate="raise",
)
def paged_raise(self: Any, customer: str, page: int, last: int, how: dict[str, Any]) -> Any:
    """``paged`` whose duplicates raise ``DuplicateTaskError``."""
    return _page(self, customer, page, last, how)


@locked_task(app, "r.paged_started", lock_key="paged_started:{customer}", dedupe="until_started")
def paged_started(self: Any, customer: str, page: int, last: int, how: dict[str, Any]) -> Any:
    """``paged`` under an ``until_started`` mark."""
    return _page(self, customer, page, last, how)


@locked_task(
    app, "r.paged_once", lock_key="paged_once:{customer}", once=True, dedupe="until_finished"
)
def paged_once(self: Any, customer: str, page: int, last: int, how: dict[str, Any]) -> Any:
    """``paged``, ``once``."""
    return _page(self, customer, page, last, how)
