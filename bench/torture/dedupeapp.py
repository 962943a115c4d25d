"""The Celery app of the dedupe soak (``dedupesoak.py``): one ``sync`` task with
``dedupe="until_started"`` (or ``DLOCK_DSOAK_MODE``), and the producer loop that submits it,
configured by environment.

    DLOCK_DSOAK_BROKER     redis://127.0.0.1:PORT/7 (a private redis-server)
    DLOCK_DSOAK_LOCKS      the lock store (a private redis-server, its own ``appendfsync
                           always`` file)
    DLOCK_DSOAK_NAMESPACE  the lock keys' namespace (fresh per run)
    DLOCK_DSOAK_LOGS       the directory of the logs, one file per process
    DLOCK_DSOAK_TTL        the marks' ``dedupe_ttl``, seconds
    DLOCK_DSOAK_MODE       the task's ``dedupe``: ``until_started`` or ``until_finished``
    DLOCK_DSOAK_COUNTDOWN  each call's ``countdown``, seconds (0: none), as a debounced
                           webhook's: its message waits in a worker's ETA schedule
    DLOCK_DSOAK_ACKS       ``late`` (``acks_late``, the default here) or ``early`` (Celery's)

Each body logs ``{"e": "start", "c", "task", "fence", "t"}`` as it starts (its lease held)
and ``{"e": "end", "task", "t"}`` as it ends, to ``body-<pid>.jsonl``; each producer logs
``{"e": "call", "c", "id", "t"}`` before an ``apply_async`` under its own task id and
``{"e": "ret", "id", "got", "t"}`` (the id it was given: its own if sent, the queued one's if
a duplicate) or ``{"e": "err", "id", "error", "t"}`` after it, to ``producer-<pid>.jsonl``.
``t`` is ``time.time()``: the host's clock, which the lock store's records use too.
"""

from __future__ import annotations

import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from celery_dlock import LockedTask, install

from .common import append_jsonl, soak_config

ENV = os.environ.get
LOGS = Path(ENV("DLOCK_DSOAK_LOGS", "."))
COUNTDOWN = float(ENV("DLOCK_DSOAK_COUNTDOWN", "0"))

app = Celery("dlock_dedupe_soak")
app.conf.update(
    soak_config(
        ENV("DLOCK_DSOAK_BROKER", "redis://127.0.0.1:6379/7"),
        ENV("DLOCK_DSOAK_LOCKS", "memory://"),
        ENV("DLOCK_DSOAK_NAMESPACE", "dsoak"),
        10,
    )
)
# Celery's default: each message acknowledged as a child takes it (a child killed then loses
# it), not after its run.
app.conf.task_acks_late = ENV("DLOCK_DSOAK_ACKS", "late") == "late"
install(app)


def log(kind: str, **entry: Any) -> None:
    """One line of this process's log (``kind``: ``body`` or ``producer``)."""
    append_jsonl(LOGS / f"{kind}-{os.getpid()}.jsonl", entry)


@app.task(
    base=LockedTask,
    bind=True,
    name="dsoak.sync",
    lock_key="sync:{customer}",
    dedupe=ENV("DLOCK_DSOAK_MODE", "until_started"),
    dedupe_ttl=float(ENV("DLOCK_DSOAK_TTL", "10")),
    lock_retry_backoff=0.1,
    lock_retry_backoff_max=1.0,
    max_retries=None,
)
def sync(self: Any, customer: int) -> None:
    """Sync a customer: what a webhook asks for; it must start after every webhook that
    was coalesced into it."""
    lease = self.lease
    log("body", e="start", c=customer, task=self.request.id, fence=lease.fence, t=time.time())
    time.sleep(random.uniform(0.005, 0.03))
    log("body", e="end", task=self.request.id, t=time.time())


def submit(customer: int) -> None:
    """One webhook: ``apply_async`` under a fresh id, logged before and after."""
    mine = str(uuid.uuid4())
    log("producer", e="call", c=customer, id=mine, t=time.time())
    try:
        got = sync.apply_async((customer,), task_id=mine, countdown=COUNTDOWN or None).id
    except Exception as exc:  # the broker or the store restarting: the caller was told
        log("producer", e="err", id=mine, error=type(exc).__name__, t=time.time())
        time.sleep(0.05)
        return
    log("producer", e="ret", id=mine, got=got, t=time.time())


def produce(seconds: float, customers: int, seed: int) -> None:
    """Submit webhooks for ``seconds``, most of them for a few hot customers."""
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hot = rng.random() < 0.7
        submit(rng.randrange(3) if hot else rng.randrange(customers))
        time.sleep(rng.uniform(0, 0.004))


if __name__ == "__main__":
    produce(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
