"""The dedupe soak: ``python -m bench.torture.dedupesoak [--seconds 40] [--producers 4] ...``.

Webhooks for a few customers, submitted as fast as four producer processes can, to
``dedupeapp.sync``: a ``LockedTask`` with ``dedupe="until_started"``, through a real
``celery worker -P prefork -c 4`` (``acks_late``). Broker and lock store are two private
``redis-server`` processes (``appendfsync always``; ``--store postgres``: the store a
private PostgreSQL, restarted ``-m fast``; ``pgbouncer``: the same behind a transaction
pooler, ``liveness=ttl``; ``redis-cluster``: three primaries and their replicas, restarted
by a failover that loses the dying primary's last writes; ``file``, ``s3``, ``gcs``: not
restarted).
Meanwhile, at random moments: worker children SIGKILLed (``--child-kills``), producers
SIGKILLed (``--producer-kills``) and started again, and ``--restarts`` restarts of the
broker and of the store (Redis SIGKILLed and restarted on its append-only file: nothing
acknowledged is lost). Then the producers stop,
the marks of killed producers run out (``--ttl``), one last webhook per customer is
submitted, the queue drains, and the checker reads every log and the store's history.

What ``until_started`` promises a caller: a webhook it coalesces (``apply_async`` returned a
queued message's id, nothing sent) is followed by a run that starts after it, so that the
run sees what the webhook announced. The checker holds every coalesced webhook to it, by
the start of the message it was given (its body's log line, or its mark ended ``dequeued``
as a worker took it), and reports each one that is not, by cause:
- **started before the webhook** (a violation): the message had started when its id was
  returned: the webhook's news came after the run read the data.
- **coalesced as its run started** (reported): the call began within ``RELEASE_SLACK``
  after its mark's ``dequeued`` record and before the body's start: a record's time is its
  release statement's start, and a call may read the mark until that statement commits
  (through PgBouncer: 2 ms after it, 2026-11-29); on S3 and GCS within
  ``OBJECT_STORE_SLACK``: the record's time is the store's clock, known within a second.
- **coalesced into a mark a failover brought back** (reported; ``--store redis-cluster``):
  the message had started within ``FAILOVER_WINDOW`` of a failover's start, and its mark
  ran out (``expired``) instead of ending ``dequeued``: the dying primary acknowledged the
  release, its replica never had it, and calls are coalesced into the started message until
  the mark's ``dedupe_ttl`` ends. (``until_finished``: its run had ended then.) With
  ``--store-options replicas=1`` (a release counts once the replica has it) there are none.
- **never ran, sent** (a violation): the message was sent (its producer was told so) but no
  worker started it.
- **never ran, sent before a broker restart, its mark expired** (reported): the broker
  lost the message (kombu's Redis transport can lose one it was handing to a worker as the
  server is killed); the mark runs out at ``dedupe_ttl``.
- **never ran, its send failed** (reported, the design's known window): the mark is taken
  before the send; a webhook coalesced while the send was under way, which then failed.
- **never ran, its producer was killed** (excused): the producer died between its mark and
  the end of its send; the mark runs out at ``dedupe_ttl``.
Also: every customer's last webhook (no faults then) is followed by a run; no two bodies of
a customer overlap (the body lock); the number of bodies against the webhooks.

``--mode until_finished``: the task's ``dedupe="until_finished"``, whose promise is
celery-once's: while a message is queued or running, a call sends nothing. A call coalesced
into a run that had begun is then kept; what the checker holds a coalesced call to instead:
- **its mark had ended before the webhook** (a violation): the producer read a mark the
  store had released already (``RELEASE_SLACK`` before the call: a record's time is its
  release statement's start).
- **coalesced after its run had ended** (a violation): more than ``RELEASE_WINDOW`` after the
  message's last body ended: its mark outlived its run (a release that did not reach the
  store, settled late). Within the window: reported (the mark is released just after the
  body returns). Reported too: a run whose child was killed after its body ended and before
  its mark's release, which the worker's parent ends ``disconnected`` once Celery reports
  the child lost: after ``worker_lost_wait`` (10 s), while calls are coalesced into it.
  Reported too: calls coalesced after a run that ended as the store restarted: the store
  refused its mark's release, which its process tries again at its next release that
  reaches the store (and never, if that pool child is killed first: the mark runs out).
- **never ran**: as above; and a message whose mark ended ``disconnected`` before it ever
  started (its pool child killed first: Celery does not run it again, and the callers'
  result reads ``FAILURE``): reported.
- **a mark that ended before its message first ran**, other than by expiry (a violation): a
  second message could be sent while the first was still to run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from .common import stop_worker
from .servers import (
    STORES,
    PooledPostgresServer,
    PostgresServer,
    RedisServer,
    Store,
    make_store,
)

REPO = Path(__file__).resolve().parents[2]
BROKER_DB = 7
#: How each store restarts, losing nothing it acknowledged (but a failover: what the dying
#: primary had not passed to its replica); the file store and the object stores do not.
STORE_RESTART = {
    "postgres": "fast", "pgbouncer": "fast", "redis": "aof", "redis-cluster": "failover",
}  # fmt: skip
#: A start found this many seconds before the webhook still counts as after it: the two
#: clocks read are the host's, by two processes (none needed so far: kept at 0).
SLACK = 0.0
#: ``until_finished``: seconds after its body's end that a call may still be coalesced into
#: a message, its mark being released (a store round trip or two) after the body returns.
RELEASE_WINDOW = 1.0
#: Seconds from a failover's start (its primary cut off from its replica) within which a
#: write to that primary may be lost: the cut, the kill, the replica's promotion.
FAILOVER_WINDOW = 2.0
#: A mark's record says when its release statement began (Postgres: ``now()``), not when it
#: was committed, after which a producer's look no longer finds it: a call this much after
#: that time may still have found the mark.
RELEASE_SLACK = 0.05
#: The same for S3 and GCS, whose records carry the store's clock as read from the ``Date``
#: of its responses (whole seconds): known within a second.
OBJECT_STORE_SLACK = 1.0
#: ``until_finished``: how a mark may end before its message runs: its ttl ran out (the
#: message waited longer), or its pool child was killed (the message runs again only if the
#: broker gives it again).
EARLY_ENDS = ("expired", "disconnected")
#: ``until_finished``: a call coalesced after its run ended, its mark's release refused by
#: the store restarting as the run ended, and tried again at its process's next release
#: that reached the store (or, that child killed first, never: the mark runs out).
HELD_UP = "coalesced after its run ended, its mark's release held up by a store restart"
#: A call coalesced into a mark that a Redis Cluster failover brought back after its
#: message's run had started (``until_finished``: ended): the dying primary had acknowledged
#: the mark's release, its replica never had it (the README's Redis Cluster section).
FAILED_OVER = "coalesced into a mark a failover brought back (its release lost)"
#: The verdicts whose calls are printed (the first five of each).
SHOWN = ("VIOLATION", "never ran, its send", "never ran, sent", FAILED_OVER, HELD_UP)


class DedupeSoak:
    def __init__(self, options: argparse.Namespace) -> None:
        self.o = options
        self.random = random.Random(options.seed)
        self.directory = Path(tempfile.mkdtemp(prefix="dlock-dsoak-"))
        self.logs = self.directory / "logs"
        self.logs.mkdir()
        self.broker = RedisServer(restart_delay=0.0)
        self.store: Store = make_store(options.store, restart_delay=0.0)
        self.namespace = f"dsoak{os.urandom(3).hex()}"
        self.worker: subprocess.Popen[bytes] | None = None
        self.producers: list[subprocess.Popen[bytes]] = []
        self.events: list[dict[str, Any]] = []

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DLOCK_DSOAK_BROKER": f"redis://127.0.0.1:{self.broker.port}/{BROKER_DB}",
            "DLOCK_DSOAK_LOCKS": self.store_url(),
            "DLOCK_DSOAK_NAMESPACE": self.namespace,
            "DLOCK_DSOAK_LOGS": str(self.logs),
            "DLOCK_DSOAK_TTL": str(self.o.ttl),
            "DLOCK_DSOAK_MODE": self.o.mode,
            "DLOCK_DSOAK_COUNTDOWN": str(self.o.countdown),
            "DLOCK_DSOAK_ACKS": self.o.acks,
        }

    def store_url(self) -> str:
        """The lock store's URL; through a pooler, leases alive by their ttl (the URL's
        ``ttl`` for the body locks, the marks' own ``--ttl``)."""
        url = self.store.url()
        if isinstance(self.store, PooledPostgresServer):
            url = f"{url}?liveness=ttl&ttl=10"
        if self.o.store_options:
            url += ("&" if "?" in url else "?") + self.o.store_options
        return url

    def start_worker(self) -> None:
        args = [
            sys.executable, "-m", "celery", "-A", "bench.torture.dedupeapp", "worker",
            "-P", "prefork", "-c", "4", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "--loglevel=WARNING",
        ]  # fmt: skip
        with open(self.directory / "worker.log", "ab") as log:
            self.worker = subprocess.Popen(
                args, env=self.env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )

    def start_producer(self, seconds: float) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "bench.torture.dedupeapp", str(seconds),
                str(self.o.customers), str(self.random.randrange(1 << 30))]  # fmt: skip
        with open(self.directory / "producers.log", "ab") as log:
            return subprocess.Popen(
                args, env=self.env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )

    def children(self) -> list[int]:
        if self.worker is None or self.worker.poll() is not None:
            return []
        path = Path(f"/proc/{self.worker.pid}/task/{self.worker.pid}/children")
        with contextlib.suppress(OSError):
            return [int(pid) for pid in path.read_text().split()]
        return []

    def chaos(self, stop: threading.Event, until: float) -> None:
        """Faults at random moments until ``until`` (monotonic)."""
        plan = ["child"] * self.o.child_kills + ["producer"] * self.o.producer_kills
        restarts = ["broker", "store"] if self.store.restart_kinds else ["broker"]
        plan += restarts * self.o.restarts
        self.random.shuffle(plan)
        span = until - time.monotonic() - 2.0
        times = sorted(self.random.uniform(1.0, span) for _ in plan)
        began = time.monotonic()
        for at, what in zip(times, plan, strict=True):
            if stop.wait(max(0.0, began + at - time.monotonic())):
                return
            event: dict[str, Any] = {"e": what, "t": time.time()}
            try:
                if what == "child" and (children := self.children()):
                    event["pid"] = victim = self.random.choice(children)
                    os.kill(victim, signal.SIGKILL)
                elif what == "producer":
                    alive = [p for p in self.producers if p.poll() is None]
                    if alive:
                        victim_p = self.random.choice(alive)
                        event["pid"] = victim_p.pid
                        victim_p.kill()
                        left = max(0.5, until - time.monotonic())
                        self.producers.append(self.start_producer(left))
                elif what == "broker":
                    self.broker.restart("aof")
                elif what == "store":  # nothing acknowledged lost (aof, a fast shutdown)
                    self.store.restart(STORE_RESTART[self.store.name])  # but by a failover
                if self.worker is not None and self.worker.poll() is not None:
                    event["worker_exited"] = self.worker.returncode
                    self.start_worker()
            except Exception as exc:  # a failed fault is reported, not fatal
                event["error"] = repr(exc)
            self.events.append(event)

    def drained(self, broker: Any) -> bool:
        with contextlib.suppress(Exception):
            waiting = int(broker.llen("celery"))
            unacked = int(broker.hlen("unacked"))
            return waiting == 0 and unacked == 0
        return False

    def run(self) -> int:
        import redis as redis_py

        try:
            self.broker.start()
            self.store.start()
            if isinstance(self.store, PostgresServer):  # the tables, not through a pooler
                from celery_dlock.backends.postgres import PostgresBackend

                store = self.store
                url = store.direct_url() if isinstance(store, PooledPostgresServer) else store.url()
                created = PostgresBackend.from_url(url)
                created.migrate()
                created.close()
            broker = redis_py.Redis(port=self.broker.port, db=BROKER_DB, socket_timeout=5)
            os.environ.update({k: v for k, v in self.env().items() if k.startswith("DLOCK_")})
            self.start_worker()
            time.sleep(2.0)
            until = time.monotonic() + self.o.seconds
            self.producers = [self.start_producer(self.o.seconds) for _ in range(self.o.producers)]
            stop = threading.Event()
            chaos = threading.Thread(target=self.chaos, args=(stop, until), daemon=True)
            chaos.start()
            while time.monotonic() < until + 1:
                if self.worker is not None and self.worker.poll() is not None:
                    self.events.append({"e": "worker_exit", "t": time.time(),
                                        "code": self.worker.returncode})  # fmt: skip
                    self.start_worker()
                time.sleep(0.2)
            stop.set()
            chaos.join(30)
            for producer in self.producers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    producer.wait(30)
            time.sleep(self.o.ttl + 1)  # the marks of killed producers run out
            from .dedupeapp import submit

            last = time.time()
            for customer in range(self.o.customers):
                submit(customer)
            deadline = time.monotonic() + 120
            while not self.drained(broker) and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)
            self.stop_worker()
            return self.check(last)
        finally:
            self.stop_worker()
            for producer in self.producers:
                if producer.poll() is None:
                    producer.kill()
            self.broker.stop()
            self.store.stop()
            if self.o.keep:
                (self.directory / "events.json").write_text(json.dumps(self.events))
                shutil.copytree(self.directory, Path(self.o.keep) / self.directory.name)
            shutil.rmtree(self.directory, ignore_errors=True)

    def stop_worker(self) -> None:
        stop_worker(self.worker)
        self.worker = None

    def check(self, last: float) -> int:
        """Read the logs and the store's history; print the table; 1 on a violation."""
        from celery_dlock.backends import backend_from_url

        slack = OBJECT_STORE_SLACK if self.o.store in ("s3", "gcs") else RELEASE_SLACK
        logs = Logs(self.logs, self.o.mode, slack)
        logs.broker_restarts = [e["t"] for e in self.events if e["e"] == "broker"]
        logs.store_restarts = [e["t"] for e in self.events if e["e"] == "store"]
        if self.store.name == "redis-cluster":
            logs.failovers = logs.store_restarts
        store = backend_from_url(self.store_url())
        try:
            records = store.history(limit=None)
            marks = logs.add_dequeued(records)
        finally:
            store.close()
        if self.o.keep:  # the store's history beside the logs
            lines = [json.dumps({**r.lease.to_dict(), "released_at": r.released_at,
                                 "outcome": r.outcome.value, "details": r.details})
                     for r in records]  # fmt: skip
            (self.directory / "history.jsonl").write_text("\n".join(lines))
        verdicts, examples = logs.verdicts()
        unsynced = [c for c in range(self.o.customers) if not logs.started_after(c, last)]
        overlaps = logs.overlaps()
        violations = sum(n for v, n in verdicts.items() if v.startswith("VIOLATION"))
        violations += len(unsynced) + overlaps
        early = logs.ended_before_run() if self.o.mode == "until_finished" else Counter()
        violations += sum(n for how, n in early.items() if how not in EARLY_ENDS)
        o = self.o
        print(f"dedupe soak ({o.mode}, countdown {o.countdown:g} s, acks {o.acks}) on {o.store}: "
              f"{o.seconds:.0f} s, {o.producers} producers, {o.customers} customers, "
              f"ttl {o.ttl:.0f} s, seed {o.seed}")  # fmt: skip
        print(logs.summary())
        faults = Counter(e["e"] for e in self.events)
        print(f"faults: {dict(faults)}; errors: {[e for e in self.events if 'error' in e]}")
        print(f"marks ended: {dict(marks)}")
        for verdict, n in sorted(verdicts.items()):
            print(f"  {verdict}: {n:,}")
            for example in examples.get(verdict, [])[:5]:
                print(f"      {example}")
        print(f"last webhooks not followed by a run: {unsynced}")
        print(f"overlapping bodies: {overlaps}")
        if o.mode == "until_finished":
            print(f"marks ended before their message first ran: {dict(early)} "
                  f"(violations unless {', '.join(EARLY_ENDS)})")  # fmt: skip
        print(f"violations: {violations}")
        return 1 if violations else 0


class Logs:
    """The producers' and the bodies' logs of a run."""

    def __init__(
        self, directory: Path, mode: str = "until_started", record_slack: float = RELEASE_SLACK
    ) -> None:
        self.mode = mode
        #: How much earlier than its release's end a record's time may be.
        self.record_slack = record_slack
        lines: list[dict[str, Any]] = []
        #: Each body that ended: (customer, start, end), paired in its process's log (a
        #: message redelivered runs again under the same task id).
        self.spans: list[tuple[int, float, float]] = []
        for path in directory.glob("*.jsonl"):
            start: dict[str, Any] | None = None
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line cut by a SIGKILL
                    lines.append(entry := json.loads(line))
                    if entry["e"] == "start":
                        start = entry
                    elif entry["e"] == "end" and start and start["task"] == entry["task"]:
                        self.spans.append((start["c"], start["t"], entry["t"]))
        self.calls = {x["id"]: x for x in lines if x["e"] == "call"}
        self.rets = {x["id"]: x for x in lines if x["e"] == "ret"}
        self.errs = {x["id"]: x for x in lines if x["e"] == "err"}
        self.starts = [x for x in lines if x["e"] == "start"]
        self.ended = sum(1 for x in lines if x["e"] == "end")
        #: How each message's mark ended, and when, by task id (``add_dequeued``).
        self.mark_ends: dict[str, str] = {}
        self.mark_released: dict[str, float] = {}
        #: Broker restarts (``time.time()``): a message sent just before one may be lost.
        self.broker_restarts: list[float] = []
        #: Store restarts (``time.time()``): a release refused meanwhile is tried again later.
        self.store_restarts: list[float] = []
        #: Redis Cluster failovers (``time.time()``): they lose the last writes of a primary.
        self.failovers: list[float] = []
        #: Each message's first start: its body's log line, or its mark ended ``dequeued``.
        self.started: dict[str, float] = {}
        for s in self.starts:
            self.started[s["task"]] = min(self.started.get(s["task"], s["t"]), s["t"])
        #: Each message's first start by its body's log line alone.
        self.body_started = dict(self.started)
        #: Each message's last body end (a redelivered message runs again).
        self.last_end: dict[str, float] = {}
        for x in lines:
            if x["e"] == "end":
                self.last_end[x["task"]] = max(self.last_end.get(x["task"], x["t"]), x["t"])

    def add_dequeued(self, records: list[Any]) -> Counter[str]:
        """Take the marks' ends from the store's ``records`` (a mark ended ``dequeued`` as a
        worker took its message); returns how the marks ended."""
        from celery_dlock import Outcome
        from celery_dlock.keys import MARK

        marks = [r for r in records if MARK in r.lease.key]
        for r in marks:
            task_id = r.lease.holder.task_id
            self.mark_ends[task_id or ""] = r.outcome.value
            self.mark_released[task_id or ""] = r.released_at
            if r.outcome is Outcome.DEQUEUED and task_id:
                self.started[task_id] = min(self.started.get(task_id, r.released_at), r.released_at)
        return Counter(r.outcome.value for r in marks)

    def verdict(self, t0: float, got: str) -> str:
        if self.mode == "until_finished":
            return self.verdict_finished(t0, got)
        if got in self.started:
            if self.started[got] >= t0 - SLACK:
                return "coalesced, run started after"
            body = self.body_started.get(got)
            late = self.started[got] >= t0 - self.record_slack
            if (body is None or body >= t0 - SLACK) and late:
                return "coalesced as its run started (its mark being released)"
            if self.failed_over(got, self.started[got]):
                return FAILED_OVER
            return "VIOLATION started before the webhook"
        return self.never_ran(t0, got)

    def never_ran(self, t0: float, got: str) -> str:
        """A call coalesced into a message that no worker started: why."""
        if got in self.rets:
            sent = self.calls[got]["t"] if got in self.calls else t0
            lost = any(sent <= t <= sent + 5.0 for t in self.broker_restarts)
            if lost and self.mark_ends.get(got) == "expired":
                return "never ran, sent before a broker restart (lost?), mark expired"
            return "VIOLATION never ran, sent"
        if got in self.errs:
            return "never ran, its send failed"
        return "never ran, its producer was killed (excused)"

    def verdict_finished(self, t0: float, got: str) -> str:
        """``until_finished``: coalesced while the message was queued or running."""
        released = self.mark_released.get(got)
        if released is not None and released < t0 - self.record_slack:
            return "VIOLATION its mark had ended before the webhook"
        if got in self.started:
            end = self.last_end.get(got)
            if end is None or end >= t0 - SLACK:
                return "coalesced, queued or running"
            if t0 - end <= RELEASE_WINDOW:
                return "coalesced as its run ended (its mark being released)"
            if self.mark_ends.get(got) == "disconnected":
                return "coalesced after its run ended, its child killed before the mark's end"
            if self.failed_over(got, end):
                return FAILED_OVER
            if any(end - RELEASE_WINDOW <= r <= t0 for r in self.store_restarts):
                return HELD_UP
            return "VIOLATION coalesced after its run had ended"
        if got in self.rets and self.mark_ends.get(got) == "disconnected":
            return "never ran, its child killed first (its result FAILURE)"
        return self.never_ran(t0, got)

    def failed_over(self, got: str, released: float) -> bool:
        """Whether the mark of message ``got``, released at ``released`` (its run's start, or
        end), was brought back by a failover that lost that release: it ran out instead."""
        return self.mark_ends.get(got) == "expired" and any(
            f <= released <= f + FAILOVER_WINDOW for f in self.failovers
        )

    def verdicts(self) -> tuple[Counter[str], dict[str, list[str]]]:
        """Each answered webhook: sent, or coalesced and what became of the message."""
        verdicts: Counter[str] = Counter()
        examples: dict[str, list[str]] = defaultdict(list)
        for mine, ret in self.rets.items():
            call = self.calls.get(mine)
            if call is None or ret["got"] == mine:
                verdicts["sent"] += 1
                continue
            got, t0 = ret["got"], call["t"]
            verdict = self.verdict(t0, got)
            verdicts[verdict] += 1
            if verdict.startswith(SHOWN):
                late = self.started.get(got)
                when = "" if late is None else f" started at {late:.4f} ({late - t0:+.4f} s)"
                examples[verdict].append(f"{mine} at {t0:.4f} given {got}{when}")
        return verdicts, examples

    def ended_before_run(self) -> Counter[str]:
        """``until_finished``: messages whose mark ended before their first run, by how (a
        second message could then be sent while the first was still to run)."""
        found: Counter[str] = Counter()
        for task, start in self.started.items():
            released = self.mark_released.get(task)
            if released is not None and released < start - SLACK:
                found[self.mark_ends[task]] += 1
        return found

    def started_after(self, customer: int, t: float) -> bool:
        return any(s["c"] == customer and s["t"] >= t for s in self.starts)

    def overlaps(self) -> int:
        """Bodies of one customer that ran at once (those that ended)."""
        spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for customer, start, end in self.spans:
            spans[customer].append((start, end))
        return sum(
            1 for one in spans.values() for a, b in itertools.pairwise(sorted(one)) if b[0] < a[1]
        )

    def summary(self) -> str:
        cut = len(self.calls) - len(self.rets) - len(self.errs)
        return (
            f"webhooks {len(self.calls):,}: answered {len(self.rets):,}, failed "
            f"{len(self.errs):,}, cut by a kill {cut:,}; bodies started {len(self.starts):,}, "
            f"ended {self.ended:,}"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=STORES, default="redis")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--restarts", type=int, default=1, help="of the broker and the store")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--customers", type=int, default=20)
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--child-kills", type=int, default=10)
    parser.add_argument("--producer-kills", type=int, default=3)
    parser.add_argument("--mode", choices=("until_started", "until_finished"),
                        default="until_started", help="the task's dedupe")  # fmt: skip
    parser.add_argument("--countdown", type=float, default=0.0, help="each call's countdown")
    parser.add_argument("--acks", choices=("late", "early"), default="late",
                        help="acks_late (late), or Celery's default (early)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store-options", default="",
                        help="more options of the store's URL (replicas=1, say)")  # fmt: skip
    parser.add_argument("--keep", default=None, help="copy the logs to this directory")
    return DedupeSoak(parser.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
