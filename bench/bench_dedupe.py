"""Producer-side cost of enqueue-time de-duplication: ``apply_async`` per second.

    python bench/bench_dedupe.py [--rounds 5] [--seconds 1.0]

Where the time goes (open the file in https://www.speedscope.app; under ``dedupe.send``:
``Task.apply_async`` is Celery's send, ``Lock.attempt`` and ``_hand_over`` one script each):

    py-spy record -r 500 --format speedscope -o /tmp/dedupe.json -- \\
        python bench/bench_dedupe.py --rounds 3

One Celery app on a Redis broker (db 6; nobody consumes: only the producer is measured), the
marks in Redis (db 7), interleaved round by round (``benchlib``):

- ``plain``: ``apply_async`` of a plain task (the floor: one message to Redis).
- ``celery-dlock``: a ``LockedTask`` with ``dedupe="until_finished"``: mark (a lease with
  fence and holder, one Lua script, ``SEND_TTL`` while sending) + message + the mark's
  hand-over to the message (a second script: it then lives by ``dedupe_ttl``).
- ``celery-dlock, no crash bound``: what celery-singleton does, in our terms: the same mark
  (lease, fence, holder, history) taken once with the whole ``dedupe_ttl``, no hand-over.
  It gives up the crash bound: a producer killed between mark and send blocks the key for
  ``dedupe_ttl`` (an hour), not ``SEND_TTL``. Not a mode of the library; here to price the
  promise (its gap to ``celery-dlock``) and the lease itself (its gap to celery-singleton).
- ``celery-singleton``: ``Singleton`` (``SET NX`` + message).
- ``celery-once``: ``QueueOnce`` (redis-py ``Lock`` + message).

Two workloads: every call a new key (a mark is taken and the message sent), and every call
the same key while its message is queued (a duplicate: nothing is sent, the caller gets the
queued task's ``AsyncResult``, or celery-once's ``AlreadyQueued`` with ``graceful``); the
variant of celery-dlock that differs only in sending is left out of the second.
Target (issue 15): celery-dlock >= 1.0x celery-singleton on new keys.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery, Task
from celery.utils import uuid as task_uuid

sys.path.insert(0, str(Path(__file__).parent))

from benchlib import interleaved, print_table, ratio_per_round

from celery_dlock import Holder, Lock, LockedTask, Outcome, install
from celery_dlock.celery import dedupe
from celery_dlock.celery.settings import settings

REDIS = "redis://127.0.0.1:6379"
BROKER_DB, MARKS_DB = 6, 7


def without_crash_bound(task: Any) -> Any:
    """``apply_async`` under a mark taken once with the whole ``dedupe_ttl`` and never
    handed over (celery-singleton's way, in our terms: see the module's docstring)."""

    def send(args: tuple[Any, ...]) -> Any:
        current = settings(task.app)
        key = dedupe.mark_key(task.lock_key_for(args, {}, current.namespace), task.name)
        task_id = task_uuid()
        holder = Holder.current(task_id=task_id, task_name=task.name)
        mark = Lock(current.backend, key, current.dedupe_ttl, holder=holder, renew=False)
        if mark.attempt() is None:
            queued = mark.current()
            return task.AsyncResult(None if queued is None else queued.holder.task_id)
        lease = mark.detach()
        headers = {dedupe.DEDUPE_HEADER: lease.to_dict()}
        try:
            return Task.apply_async(task, args, task_id=task_id, headers=headers)
        except BaseException:
            mark.end(lease, Outcome.FAILED, None, "the message was not sent")
            raise

    return send


def make_app(prefix: str) -> tuple[Celery, dict[str, Any]]:
    app = Celery("bench_dedupe", set_as_current=False)
    app.conf.update(
        broker_url=f"{REDIS}/{BROKER_DB}",
        task_default_queue=f"bench-dedupe-{prefix}",
        dlock_backend=f"{REDIS}/{MARKS_DB}?prefix={prefix}",
        singleton_backend_url=f"{REDIS}/{MARKS_DB}",
        singleton_key_prefix=f"{prefix}-singleton-",
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": f"{REDIS}/{MARKS_DB}", "default_timeout": 3600},
        },
    )
    install(app)
    tasks: dict[str, Any] = {}

    @app.task(name="b.plain", shared=False)
    def plain(key: str) -> None: ...

    tasks["plain"] = plain

    @app.task(
        name="b.dlock", shared=False, base=LockedTask, lock_key="k:{key}", dedupe="until_finished"
    )
    def dlock(key: str) -> None: ...

    tasks["celery-dlock"] = dlock

    @app.task(
        name="b.dlock_unbounded",
        shared=False,
        base=LockedTask,
        lock_key="k:{key}",
        dedupe="until_finished",
    )
    def dlock_unbounded(key: str) -> None: ...

    tasks["celery-dlock, no crash bound"] = dlock_unbounded
    try:
        from celery_singleton import Singleton

        @app.task(name="b.singleton", shared=False, base=Singleton)
        def singleton(key: str) -> None: ...

        tasks["celery-singleton"] = singleton
    except ImportError:
        print("celery-singleton is not installed: pip install 'celery-dlock[bench]'")
    try:
        from celery_once import QueueOnce

        @app.task(name="b.once", shared=False, base=QueueOnce, once={"graceful": True})
        def once(key: str) -> None: ...

        tasks["celery-once"] = once
    except ImportError:
        print("celery-once is not installed: pip install 'celery-dlock[bench]'")
    return app, tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    options = parser.parse_args()
    prefix = f"bd{uuid.uuid4().hex[:6]}"
    app, tasks = make_app(prefix)
    broker = redis.Redis.from_url(f"{REDIS}/{BROKER_DB}")
    marks = redis.Redis.from_url(f"{REDIS}/{MARKS_DB}")
    counter = itertools.count()
    senders = {name: task.apply_async for name, task in tasks.items()}
    senders["celery-dlock, no crash bound"] = without_crash_bound(
        tasks["celery-dlock, no crash bound"]
    )
    sending_only = ("plain", "celery-dlock, no crash bound")
    try:
        new_keys = {
            name: (lambda send=send: send((f"{prefix}-{next(counter)}",)))
            for name, send in senders.items()
        }
        same = f"{prefix}-same"
        for send in senders.values():
            send((same,))  # the one message the duplicates find queued
        duplicates = {
            name: (lambda send=send: send((same,)))
            for name, send in senders.items()
            if name not in sending_only
        }
        print(f"apply_async, {options.rounds} rounds × {options.seconds} s, Redis broker and marks")
        print("\nevery call a new key (mark + message):")
        results = interleaved(new_keys, options.rounds, options.seconds)
        print_table(results, "plain", unit="messages")
        print("\nevery call a duplicate of a queued message (nothing sent):")
        dup_results = interleaved(duplicates, options.rounds, options.seconds)
        print_table(dup_results, "celery-dlock", unit="calls")
        if "celery-singleton" in results:
            print()
            for name in [name for name in results if name.startswith("celery-dlock, ")]:
                ratio = statistics.median(ratio_per_round(results, name, "celery-singleton"))
                print(f"{name} / celery-singleton, new keys = {ratio:.2f}")
            ours = statistics.median(ratio_per_round(results, "celery-dlock", "celery-singleton"))
            verdict = "meets" if ours >= 1.0 else "MISSES"
            print(
                f"celery-dlock / celery-singleton, new keys = {ours:.2f} "
                f"({verdict} the target of ≥ 1.00)"
            )
            dup = statistics.median(
                ratio_per_round(dup_results, "celery-dlock", "celery-singleton")
            )
            print(f"celery-dlock / celery-singleton, duplicates = {dup:.2f}")
    finally:
        broker.delete(app.conf.task_default_queue)
        for pattern in (f"{{{prefix}*", f"{prefix}*", "qo_b.once*"):
            for name in marks.scan_iter(match=pattern, count=1000):
                marks.delete(name)


if __name__ == "__main__":
    main()
