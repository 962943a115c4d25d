"""A callable ``on_locked`` or ``on_duplicate`` gets the task first, whatever kind of
callable it is (the README's ``(task, key, lease)`` and ``(task, mark_key, queued_task_id)``).
Found by trying the API: a callable object or a ``functools.partial`` was called without
the task, and failed with a TypeError at the first busy key."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import pytest
from celery import Celery

from celery_dlock import Lock, LockedTask, backend_from_url, install


class Policy:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, task: Any, key: str, other: Any) -> str:
        self.calls.append((task.name, key, other))
        return "handled"


def _noted(calls: list[tuple[Any, ...]], task: Any, key: str, other: Any) -> str:
    calls.append((task.name, key, other))
    return "handled"


def _app(**conf: Any) -> Celery:
    app = Celery(f"policies-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(dlock_backend=f"memory://{uuid.uuid4().hex}", **conf)
    install(app, janitor=False)
    return app


@pytest.mark.parametrize("kind", ["object", "partial"])
def test_a_callable_on_locked_of_any_kind_gets_the_task_key_and_lease(kind: str) -> None:
    app = _app(task_always_eager=True)
    calls: list[tuple[Any, ...]] = []
    policy = Policy() if kind == "object" else functools.partial(_noted, calls)

    @app.task(shared=False, base=LockedTask, name="p.sync", lock_key="sync:{n}", on_locked=policy)
    def sync(n: int) -> str:
        return "ran"

    store = backend_from_url(app.conf.dlock_backend)
    with Lock(store, "job:sync:1") as held:
        assert sync.apply((1,)).get() == "handled"
    seen = policy.calls if isinstance(policy, Policy) else calls
    assert seen == [("p.sync", "job:sync:1", held)]


@pytest.mark.parametrize("kind", ["object", "partial"])
def test_a_callable_on_duplicate_of_any_kind_gets_the_task_mark_and_queued_id(kind: str) -> None:
    app = _app(broker_url="memory://")  # messages sent, no worker: the first stays queued
    calls: list[tuple[Any, ...]] = []
    policy = Policy() if kind == "object" else functools.partial(_noted, calls)

    @app.task(shared=False, base=LockedTask, name="p.hook", lock_key="hook:{n}",
              dedupe="until_started", on_duplicate=policy)  # fmt: skip
    def hook(n: int) -> str:
        return "ran"

    first = hook.delay(7)
    assert hook.delay(7) == "handled"
    seen = policy.calls if isinstance(policy, Policy) else calls
    assert seen == [("p.hook", "job:hook:7#queued:p.hook", first.id)]
