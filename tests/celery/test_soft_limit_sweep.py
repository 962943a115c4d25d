"""A soft time limit at every step of a LockedTask's run, one run per step, on each store.

Celery's prefork pool ends a task at its soft limit by a SIGUSR1, whose handler (billiard's,
guarded by ``celery_dlock.celery.softlimit`` as in a pool child) raises
``SoftTimeLimitExceeded`` wherever the main thread is. Here the signal is sent as the n-th
call of celery-dlock's own code starts, for every n of a run (the profile hook counts
them), in this process's main thread, as a pool child's: what each of those runs leaves
must be what the product promises, whatever the step the limit cut:

- the body's keys (its slots, its two keys) are free when the run has ended (the exception
  kept, as Celery keeps a failed task's: nothing left to the garbage collector), and its
  leases are recorded;
- the run ended as it did (the result) or with ``SoftTimeLimitExceeded``, nothing else;
- ``once``: the run returned its result if and only if its success was kept;
- ``dedupe``: the mark is gone (ended; within the first calls of the task's start, before
  the run's own handlers are in place, by the ``task_failure`` handler);
- the next run, not cut, runs and ends as a first run would.

This sweep found the file store's stripe mutex held after a cut on the way into
``Locked.__exit__`` (the next run hung), and a lease or mark left after a cut between the
lock's grant and the body (``tests/celery/test_cut_before_body.py``)."""

from __future__ import annotations

import gc
import os
import signal
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery
from celery.signals import before_task_publish

import celery_dlock
from celery_dlock import LockedTask, install
from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.celery import softlimit
from celery_dlock.celery.dedupe import mark_key
from celery_dlock.celery.settings import backend_for
from tests.backends.stores.postgres import SERVER_URL, schema_store
from tests.backends.stores.redis import URL as REDIS_URL
from tests.backends.stores.redis import delete_prefix, store_url
from tests.support import eventually
from tests.support.poolchild import pool_child

PACKAGE = str(Path(celery_dlock.__file__).parent)
KINDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "once": {"once": True},
    "until_started": {"dedupe": "until_started"},
    "until_finished": {"dedupe": "until_finished"},
    "limit": {"lock_limit": 2},  # one of two slots, job:pay:N#0 and #1
    "two_keys": {"lock_key": ["pay:{n}", "account:{n}"]},  # both or neither
}


def keys_of(kind: str, n: int) -> list[str]:
    """The store's keys a run of ``kind`` for order ``n`` may hold."""
    if kind == "limit":
        return [f"job:pay:{n}#0", f"job:pay:{n}#1"]
    if kind == "two_keys":
        return [f"job:pay:{n}", f"job:account:{n}"]
    return [f"job:pay:{n}"]


@pytest.fixture(params=["memory", "file", "postgres", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, LockBackend]]:
    """A store's URL, for the app, and a client of its own, for the checks."""
    if request.param == "memory":
        url = f"memory://sweep-{uuid.uuid4().hex[:8]}"
        yield url, MemoryBackend.from_url(url)
    elif request.param == "file":
        url = f"file://{tmp_path / 'locks'}"
        backend = FileBackend.from_url(url)
        yield url, backend
        backend.close()
    elif request.param == "postgres":
        with schema_store(SERVER_URL) as case:
            assert case.url is not None
            yield case.url, case.backend
    else:
        prefix = f"sweep-{uuid.uuid4().hex[:8]}"
        url = store_url(prefix, REDIS_URL)
        backend = celery_dlock.backend_from_url(url)
        try:
            yield url, backend
        finally:
            backend.close()
            delete_prefix(REDIS_URL, prefix)


__all__ = ["pool_child"]  # the fixture: this process as a pool child's


class Runs:
    """The task of one kind on one store, run whole or cut at the n-th call."""

    def __init__(self, url: str, kind: str) -> None:
        self.kind = kind
        self.app = Celery(f"sweep-{kind}", set_as_current=False)
        self.app.conf.update(
            broker_url="memory://",
            task_default_queue=f"sweep-{uuid.uuid4().hex[:8]}",
            dlock_backend=url,
        )
        install(self.app, janitor=False)
        self.ran: list[int] = []

        options = {"lock_key": "pay:{n}", **KINDS[kind]}

        @self.app.task(base=LockedTask, shared=False, name="sweep.pay", lock_ttl=30, **options)
        def pay(n: int) -> int:
            self.ran.append(n)
            return n

        self.task = pay
        self.headers: dict[str, Any] = {}

    def close(self) -> None:
        """Close the app's client of the store (the file store's keeps a descriptor for
        each of up to 256 keys)."""
        backend_for(self.app).close()

    def run(self, n: int, cut_at: int | None = None) -> tuple[BaseException | None, int]:
        """Run the task for order ``n`` (cut as the ``cut_at``-th call starts): the exception
        it ended with, and how many calls of our code it made."""
        calls = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal calls
            if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
                calls += 1
                if calls == cut_at:
                    os.kill(os.getpid(), signal.SIGUSR1)

        headers = self._marked(n) if self.kind.startswith("until") else None
        gc.disable()  # no finalizer of an earlier run's objects among the calls counted
        # (a limit that comes in one is sent again later: test_soft_limit_release.py)
        sys.setprofile(profile)
        try:
            if headers is None:
                self.task(n)
                return None, calls
            sent = self.task.apply((n,), task_id=headers["id"], headers=headers)
            result = sent.result
            return (result if isinstance(result, BaseException) else None), calls
        except BaseException as exc:
            return exc, calls
        finally:
            sys.setprofile(None)
            gc.enable()
            # A limit that came inside a release is sent again a few ms later: it lands
            # here (dropped: its run has ended), not in a later run's steps.
            eventually(lambda: softlimit._guard.again is None, "the limit sent again")

    def _marked(self, n: int) -> dict[str, Any]:
        """Send the task for ``n`` (its mark taken, the message to the memory broker, which
        no one reads) and return the message's headers, for ``apply``."""
        seen: list[dict[str, Any]] = []

        def grab(sender: str, headers: dict[str, Any], **_: Any) -> None:
            if sender == self.task.name:
                seen.append(dict(headers))

        before_task_publish.connect(grab, weak=False)
        try:
            self.task.apply_async((n,))
        finally:
            before_task_publish.disconnect(grab)
        assert seen, f"apply_async({n}) sent nothing: a mark of order {n} is held"
        [headers] = seen
        return headers


def _problems(runs: Runs, backend: LockBackend, n: int, exc: BaseException | None) -> list[str]:
    key, keys, problems = f"job:pay:{n}", keys_of(runs.kind, n), []
    if exc is not None and not isinstance(exc, SoftTimeLimitExceeded):
        problems.append(f"ended by {exc!r}")
    if any(backend.get(one) is not None for one in keys):
        problems.append("a key is held")
    recorded = [bool(backend.history(key=one)) for one in keys]
    if runs.ran and not (any(recorded) if runs.kind == "limit" else all(recorded)):
        problems.append("a lease without a record")
    if runs.kind == "once":
        kept = backend.last_success(key, runs.task.name) is not None
        if (exc is None) != kept:
            problems.append(f"returned: {exc is None}, success kept: {kept}")
    if runs.kind.startswith("until") and backend.get(mark_key(key, runs.task.name)):
        problems.append("the mark is held")
    return problems


@pytest.mark.slow
@pytest.mark.usefixtures("pool_child")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_soft_limit_at_any_step_of_a_run_leaves_what_the_run_promises(
    store: tuple[str, LockBackend], kind: str, request: pytest.FixtureRequest
) -> None:
    url, backend = store
    runs = Runs(url, kind)
    request.addfinalizer(runs.close)
    runs.run(0)  # the guard in place, the connections open
    exc, steps = runs.run(1)
    assert exc is None and runs.ran == [0, 1]
    found: Counter[str] = Counter()
    cut: list[BaseException] = []  # Celery keeps a failed task's traceback: so do we
    for step in range(1, steps + 1):
        n = 1000 + step
        key = f"job:pay:{n}"
        runs.ran.clear()
        exc, _ = runs.run(n, cut_at=step)
        cut += [exc] if exc is not None else []
        problems = _problems(runs, backend, n, exc)
        kept = kind == "once" and backend.last_success(key, runs.task.name) is not None
        runs.ran.clear()
        again, _ = runs.run(n)  # the next run, whole: a kept success is replayed
        if again is not None:
            problems.append(f"the next run ended by {again!r}")
        if runs.ran != ([] if kept else [n]):
            problems.append(f"the next run's body ran {len(runs.ran)} times (kept: {kept})")
        if any(backend.get(one) is not None for one in keys_of(kind, n)):
            problems.append("a key is held after the next run")
        found.update(f"{problem} (a limit at call {step})" for problem in problems)
    assert not found, dict(found)
    assert cut and len(cut) < steps, "the limit never came, or was never held back"
