"""The demo: ``python -m worker_example.demo`` (no servers needed).

It starts a real prefork worker and beat as subprocesses on the embedded stack, submits
every order several times at once, SIGKILLs the worker child stuck on a hanging gateway
call, lets a crashed cron run leave a lock behind for the janitor, and prints a report.
Exit code 0 only if every order was charged exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STARTED = time.monotonic()
#: Webhook calls for one customer, and transfers each way between two accounts.
WEBHOOKS = 200
TRANSFERS = 10


def say(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:5.1f}s] {message}", flush=True)


def until(condition: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"demo failed: no {what} within {timeout:.0f} s")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description="celery-dlock payments demo (no servers)")
    parser.add_argument("--data", default="demo-data", help="working folder (emptied first)")
    parser.add_argument("--copies", type=int, default=4, help="submissions of each order")
    parser.add_argument(
        "--postgres",
        metavar="URL",
        help="keep the locks and the ledger in this PostgreSQL database (fresh schemas), so "
        "that each charge keeps its once success in its own transaction",
    )
    options = parser.parse_args()

    data = Path(options.data).absolute()
    if data.exists():
        shutil.rmtree(data)
    data.mkdir(parents=True)
    settings = {"DLOCK_EXAMPLE_DATA": str(data), "DLOCK_EXAMPLE_JANITOR": "2"}
    if options.postgres:
        settings |= _postgres_settings(options.postgres)
    env = {
        **os.environ,
        **settings,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    os.environ.update(settings)
    sys.path.insert(0, str(ROOT))

    from worker_example import gateway, tasks
    from worker_example.app import app

    where = "file locks, SQLite ledger"
    if options.postgres:
        where = f"Postgres locks and ledger in schema {settings['DLOCK_EXAMPLE_SCHEMA']}(_locks)"
    say(f"embedded stack in {data}: filesystem broker, file results, {where}")
    cards = [gateway.APPROVED] * 4 + [gateway.DECLINED_ONCE, gateway.HANGS_ONCE]
    orders = [
        (n, f"customer-{n}", Decimal(f"{10 * n}.50"), card) for n, card in enumerate(cards, 1)
    ]
    tasks.ledger.create()
    tasks.ledger.add_orders(orders)
    hanging = next(n for n, _, _, card in orders if card == gateway.HANGS_ONCE)
    declined = next(n for n, _, _, card in orders if card == gateway.DECLINED_ONCE)
    say(
        f"{len(orders)} orders; order {declined}'s card is declined once, "
        f"order {hanging}'s gateway hangs"
    )

    worker = start(
        ["worker", "--pool=prefork", "--concurrency=4", "--loglevel=INFO", "--hostname=demo@%h"],
        data / "worker.log",
        env,
    )
    beat = start(["beat", "--loglevel=INFO", "--max-interval=1"], data / "beat.log", env)
    try:
        until(lambda: app.control.ping(timeout=1.0), "worker answering pings")
        say("worker (prefork, 4 children) and beat are up; the janitor runs every 2 s")
        demo = Demo(app, tasks, gateway, orders, hanging, declined, options.copies, data, env)
        return demo.run()
    finally:
        for process in (beat, worker):
            process.send_signal(signal.SIGTERM)
        for process in (beat, worker):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        say(f"worker and beat stopped; logs in {data}")
        if "DLOCK_EXAMPLE_SCHEMA" in settings:
            schema = settings["DLOCK_EXAMPLE_SCHEMA"]
            say(
                f"left the schemas {schema} and {schema}_locks in the database, to look at; "
                f"remove them with DROP SCHEMA {schema}, {schema}_locks CASCADE"
            )


def _postgres_settings(url: str) -> dict[str, str]:
    """The lock store and the ledger in fresh schemas of one Postgres database."""
    import psycopg

    schema = f"demo_{os.urandom(4).hex()}"
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE SCHEMA {schema}")
    joiner = "&" if "?" in url else "?"
    return {
        "DLOCK_EXAMPLE_SCHEMA": schema,
        "DLOCK_EXAMPLE_LOCKS": f"{url}{joiner}schema={schema}_locks&auto_migrate=1",
        "DLOCK_EXAMPLE_LEDGER": f"{url}{joiner}options=-csearch_path%3D{schema}",
    }


def start(arguments: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "celery", "-A", "worker_example.app", *arguments]
    with open(log, "ab") as output:
        return subprocess.Popen(command, env=env, stdout=output, stderr=output, cwd=ROOT)


@dataclass
class Demo:
    """One run of the demo: the app, its orders, and where it keeps its files."""

    app: Any
    tasks: Any
    gateway: Any
    orders: list[tuple[int, str, Decimal, str]]
    hanging: int
    declined: int
    copies: int
    data: Path
    env: dict[str, str]

    def run(self) -> int:
        from celery_dlock.celery.settings import backend_for

        tasks, data = self.tasks, self.data
        store = backend_for(self.app)
        first = tasks.charge.delay(self.hanging)
        stuck = until(lambda: _read_json(data / "hanging.json"), "charge stuck at the gateway")
        say(f"order {self.hanging}: its charge hangs at the gateway in worker child {stuck['pid']}")
        results = [first]
        for _ in range(self.copies):
            results += [tasks.charge.delay(order_id) for order_id, *_ in self.orders]
        say(
            f"submitted {len(results)} charges: every order {self.copies} times at once "
            f"(order {self.hanging} once more, before)"
        )

        orphan = _crashed_cron_run(self.env, store)
        say(f"a cron run of the nightly report crashed holding {orphan}")

        time.sleep(1.0)  # give the duplicates of the stuck order time to meet its lock
        os.kill(stuck["pid"], signal.SIGKILL)
        killed_at = time.time()
        say(f"SIGKILLed worker child {stuck['pid']} in the middle of charging order {self.hanging}")

        outcomes: Counter[str] = Counter()
        for result in results:
            try:
                result.get(timeout=120, propagate=True)
                outcomes["returned a charge"] += 1
            except Exception as exc:
                outcomes[type(exc).__name__] += 1
        finished = ", ".join(f"{n} {what}" for what, n in outcomes.items())
        say(f"every submission finished: {finished}")

        until(lambda: _janitor_cleared(store, orphan), "janitor clearing the crashed run's lock")
        say("the janitor cleared the crashed cron run's lock")
        self.webhooks_and_transfers()
        return self.report(store, stuck["pid"], killed_at)

    def webhooks_and_transfers(self) -> None:
        tasks = self.tasks
        burst = [tasks.sync_customer.delay("customer-1") for _ in range(WEBHOOKS)]
        say(f"a CRM webhook fired {WEBHOOKS} times for customer-1: {len(burst)} calls to delay()")
        moves = [tasks.transfer.delay("A", "B", "5.00") for _ in range(TRANSFERS)]
        moves += [tasks.transfer.delay("B", "A", "3.00") for _ in range(TRANSFERS)]
        say(f"{len(moves)} transfers submitted at once, half A->B and half B->A")
        for result in [*burst, *moves]:
            result.get(timeout=120)

    def webhook_runs(self) -> int:
        return len((self.data / "syncs.jsonl").read_text().splitlines())

    def transfers_apart(self) -> tuple[int, bool]:
        """How many transfers ran, and whether no two ever overlapped."""
        lines = (self.data / "transfers.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
        running, apart = 0, True
        for event in events:  # written in order under a file lock
            running += 1 if event["event"] == "start" else -1
            apart = apart and running <= 1
        return len(events) // 2, apart

    def report(self, store: Any, killed_pid: int, killed_at: float) -> int:
        from celery_dlock import Outcome

        charged = self.tasks.ledger.charges_per_order()
        print("\n=== report " + "=" * 60)
        print("orders charged (ledger rows per order; each must be exactly 1):")
        for order_id, customer, amount, _ in self.orders:
            count = charged.get(order_id, 0)
            mark = "ok" if count == 1 else "WRONG"
            print(f"  order {order_id} {customer:<11} {amount:>7}  charged {count}x  {mark}")

        history = store.history(limit=None)
        charges = [r for r in history if r.key.startswith("job:order:")]
        replayed = [r for r in charges if r.outcome is Outcome.SKIPPED and r.problem == "once"]
        succeeded = [r for r in charges if r.outcome is Outcome.SUCCEEDED]
        print(
            f"\nlock history of the charges: {len(succeeded)} succeeded, {len(replayed)} "
            "duplicates replayed the stored result instead of charging again (once=True)"
        )
        print("\nthe SIGKILLed child's lock, and the crashed cron run's:")
        dead = [r for r in charges if r.lease.holder.pid == killed_pid]
        for record in dead:
            print(
                f"  {record.key} fence {record.fence} released as {record.outcome} "
                f"({record.problem}) {record.released_at - killed_at:+.2f} s after the kill"
            )
        for record in (r for r in history if r.key.startswith("job:report:crashed")):
            print(
                f"  {record.key} fence {record.fence} released as {record.outcome} by the janitor"
            )
        print("\nfailures in the history (exception type: message):")
        for record in history:
            if record.outcome is Outcome.FAILED:
                message = (record.details or "").splitlines()[0]
                print(f"  {record.key} fence {record.fence}: {record.problem}: {message}")
        print(f"\nhistory of order {self.hanging} (oldest first):")
        mine = sorted(
            (r for r in charges if r.key == f"job:order:{self.hanging}"),
            key=lambda r: r.released_at,
        )
        for record in mine:
            print(f"  fence {record.fence:>3} {record.outcome.value:<12} {record.problem or ''}")

        moved = Counter(int(str(c["order"])) for c in self.gateway.charges(self.data))
        print("\nmoney moved at the gateway (each order once; idempotency keys honoured):")
        print("  " + ", ".join(f"order {n}: {moved.get(n, 0)}x" for n, *_ in self.orders))
        transactional = self.tasks.TRANSACTIONAL_SUCCESS
        print(
            "\neach charge kept its once success in the ledger's own transaction "
            f"(record_success): {'YES' if transactional else 'NO'}"
        )
        if not transactional:
            print(
                "  (a SQLite ledger and a file lock store cannot share a transaction: the "
                "success is kept at release; run with --postgres URL to see it in one)"
            )

        runs = self.webhook_runs()
        runs_word = "run" if runs == 1 else "runs"
        print(f"\n{WEBHOOKS} webhook submissions for customer-1 became {runs} {runs_word} (dedupe)")
        moved_money, apart = self.transfers_apart()
        print(
            f"{moved_money} opposite transfers between accounts A and B, never two at once: "
            f"{'YES' if apart else 'NO'}"
        )

        exactly_once = all(
            charged.get(order_id, 0) == 1 and moved.get(order_id, 0) == 1
            for order_id, *_ in self.orders
        )
        disconnected = any(r.outcome is Outcome.DISCONNECTED for r in dead)
        typed = any(
            r.outcome is Outcome.FAILED and (r.problem or "").endswith("CardDeclined")
            for r in history
        )
        print("\n" + "=" * 71)
        print(f"every order charged exactly once: {'YES' if exactly_once else 'NO'}")
        print(
            f"the killed child's lock recorded as disconnected: {'YES' if disconnected else 'NO'}"
        )
        print(f"the declined card recorded with its exception type: {'YES' if typed else 'NO'}")
        coalesced = runs <= 2
        print(f"the webhook burst ran at most twice: {'YES' if coalesced else 'NO'}")
        settled = apart and moved_money == 2 * TRANSFERS
        return 0 if exactly_once and disconnected and typed and coalesced and settled else 1


def _crashed_cron_run(env: dict[str, str], store: Any) -> str:
    """A process on this host takes the report lock and dies by SIGKILL."""
    key = f"job:report:crashed-{int(time.time())}"
    code = (
        "import sys, time\n"
        "from celery_dlock import backend_from_url, Holder\n"
        f"lease = backend_from_url({store.url!r}).try_acquire({key!r},"
        " Holder.current(task_name='payments.nightly_report'), None)\n"
        "print(lease.fence, flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    assert process.stdout is not None
    process.stdout.readline()
    process.kill()
    process.wait()
    process.stdout.close()
    return key


def _janitor_cleared(store: Any, key: str) -> bool:
    return any(r.outcome.value == "disconnected" for r in store.history(key=key))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
