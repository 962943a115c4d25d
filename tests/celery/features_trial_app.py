"""The tasks of tests/celery/test_features_trial.py: ``LockedTask`` combined with the Celery
features users combine it with (``autoretry_for``, canvas, ``ignore_result``, class-based
tasks, a base class of the user's own), on an app of their own per lock store, run by an
embedded worker (``tests.celery.support.embedded_worker``). Bodies note what they saw in
``SEEN``, by a per-test run id."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from celery import Celery, Task

from celery_dlock import LockedTask, install
from tests.celery.support import embedded_app

SEEN: defaultdict[str, list[Any]] = defaultdict(list)


class Flaky(Exception):
    """What the gateway raises while it is down."""


def _attempt(task: Any, run: str, fails: int) -> str:
    lease = task.lease
    SEEN[run].append({"retries": task.request.retries, "token": lease.token, "key": lease.key})
    if task.request.retries < fails:
        raise Flaky(f"gateway down at attempt {task.request.retries}")
    return f"done after {task.request.retries}"


class Audited(Task):  # type: ignore[misc]  # celery has no type hints
    """A user's own base: every hook overridden, each calling its parent's."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        SEEN[args[0]].append("__call__")
        return super().__call__(*args, **kwargs)

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        SEEN[args[0]].append("before_start")
        super().before_start(task_id, args, kwargs)

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        SEEN[args[0]].append("on_success")
        super().on_success(retval, task_id, args, kwargs)

    def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        SEEN[args[0]].append("on_failure")
        super().on_failure(exc, task_id, args, kwargs, einfo)

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        SEEN[args[3][0]].append("after_return")
        super().after_return(*args, **kwargs)


class AuditedLocked(Audited, LockedTask):
    """The user's base first: its ``__call__`` wraps ``LockedTask``'s."""


class Charge(LockedTask):
    """A class-based task."""

    name = "f.charge_class"
    lock_key = "order:{order_id}"

    def run(self, order_id: str, fail: bool = False) -> str:
        SEEN[order_id].append(self.lease.key)
        if fail:
            raise Flaky("declined")
        return self.lease.key


class UrgentCharge(Charge):
    """A subclass of a task class, with a key of its own and its body inherited."""

    name = "f.urgent_charge_class"
    lock_key = "urgent:{order_id}"


def make_app(store_url: str) -> tuple[Celery, SimpleNamespace]:
    """An app on the lock store ``store_url`` and its tasks."""
    app = embedded_app("features", store_url)
    install(app, janitor=False)
    locked = {"shared": False, "base": LockedTask, "bind": True}
    retrying = {
        "autoretry_for": (Flaky,),
        "retry_backoff": True,  # 1 s, 2 s...: at most retry_backoff_max, jittered down
        "retry_backoff_max": 1,
        "retry_jitter": True,
        "max_retries": 2,
    }

    @app.task(name="f.auto", lock_key="auto:{run}", **locked, **retrying)
    def auto(self: Any, run: str, fails: int) -> str:
        return _attempt(self, run, fails)

    @app.task(name="f.auto_once", lock_key="auto:{run}", once=True, **locked, **retrying)
    def auto_once(self: Any, run: str, fails: int) -> str:
        return _attempt(self, run, fails)

    @app.task(
        name="f.auto_queued", lock_key="auto:{run}", dedupe="until_finished", **locked, **retrying
    )
    def auto_queued(self: Any, run: str, fails: int) -> str:
        return _attempt(self, run, fails)

    @app.task(name="f.quiet", lock_key="quiet:{run}", once=True, ignore_result=True, **locked)
    def quiet(self: Any, run: str) -> dict[str, Any]:
        SEEN[run].append(self.request.id)
        return {"run": run, "by": self.request.id}

    @app.task(name="f.part", lock_key="part:{run}:{n}", once=True, **locked)
    def part(self: Any, run: str, n: int) -> int:
        SEEN[run].append(("part", n))
        return n * 10

    @app.task(shared=False, name="f.total")
    def total(parts: list[int]) -> int:
        return sum(parts)

    @app.task(name="f.busy_fail", lock_key="busy:{run}", on_locked="fail", **locked)
    def busy_fail(self: Any, run: str) -> str:
        return "ran"

    @app.task(
        name="f.busy_fail_throws",
        lock_key="busy:{run}",
        on_locked="fail",
        throws=(Flaky,),
        **locked,
    )
    def busy_fail_throws(self: Any, run: str) -> str:
        return "ran"

    @app.task(name="f.busy_skip", lock_key="busy:{run}", on_locked="skip", **locked)
    def busy_skip(self: Any, run: str) -> str:
        return "ran"

    @app.task(shared=False, name="f.errback")
    def errback(request: Any, exc: Any, traceback: Any) -> None:
        SEEN[request.args[0]].append(("errback", type(exc).__name__, request.id))

    @app.task(shared=False, name="f.then")
    def then(previous: Any, run: str) -> Any:
        SEEN[run].append(("then", previous))
        return previous

    @app.task(shared=False, base=AuditedLocked, bind=True, name="f.audited", lock_key="au:{run}")
    def audited(self: Any, run: str, fail: bool) -> str:
        SEEN[run].append(("body", self.lease.key, self.request.id is not None))
        if fail:
            raise Flaky("declined")
        return "audited"

    @app.task(name="f.padded", lock_key="n:{n:>05}:{run}", **locked)
    def padded(self: Any, run: str, n: Any) -> str:
        return str(self.lease.key)

    tasks = SimpleNamespace(**{t.name[2:]: t for t in app.tasks.values() if t.name[:2] == "f."})
    tasks.charge = app.register_task(Charge())
    tasks.urgent = app.register_task(UrgentCharge())
    return app, tasks
