"""The money promises, tried as a payments engineer would, with real prefork workers, a real
Postgres (or file) store, a Redis broker and real SIGKILLs: ``once`` across a child killed
after the charge (acks_late + reject_on_worker_lost redelivers the message), the
idempotency key of a redelivery, ``record_success`` in the app's own transaction, the
janitor's pruning of a ``once`` success's history, and what the metrics count."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Outcome
from tests.celery.prefork import Worker, running
from tests.support import eventually

pytestmark = pytest.mark.slow


class PaymentsWorker(Worker):
    """A prefork worker of ``tests.celery.paymentsapp``."""

    module = "paymentsapp"

    def __init__(self, tmp: Path, redis_url: str, lock_url: str, **env: str) -> None:
        super().__init__(tmp, redis_url, lock_url, **env)
        self.gateway = tmp / "gateway.jsonl"

    def start(self, concurrency: int = 2) -> PaymentsWorker:
        super().start(concurrency)
        return self

    def gateway_calls(self, order: str) -> list[dict[str, Any]]:
        if not self.gateway.exists():
            return []
        lines = self.gateway.read_text().splitlines()
        return [call for call in map(json.loads, lines) if call["order"] == order]


@pytest.fixture
def payments(tmp_path: Path, redis_url: str, lock_url: str) -> Iterator[PaymentsWorker]:
    with running(tmp_path, redis_url, lock_url, PaymentsWorker) as worker:
        yield worker


def charges_of(lock_url: str, order: str) -> list[str]:
    """The references of ``order`` in the app's ledger table (beside the store's tables)."""
    import psycopg

    url, table = lock_url.partition("?")[0], f'"{lock_url.split("schema=")[1]}".payments_ledger'
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE TABLE IF NOT EXISTS {table} (order_id text, ref text)")
        rows = connection.execute(f"SELECT ref FROM {table} WHERE order_id = %s", (order,))
        return [str(row[0]) for row in rows.fetchall()]


DEAD_HOLDER = (
    "import os, signal, sys\n"
    "from celery_dlock import Holder, backend_from_url\n"
    "store = backend_from_url(sys.argv[1])\n"
    "for key in sys.argv[2:]:\n"
    "    assert store.try_acquire(key, Holder.current(), None) is not None\n"
    "print('held', flush=True)\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


def held_by_a_killed_process(lock_url: str, keys: list[str]) -> None:
    """Take ``keys`` in a process that is then SIGKILLed: leases whose holder is gone."""
    done = subprocess.run(
        [sys.executable, "-c", DEAD_HOLDER, lock_url, *keys],
        capture_output=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL and done.stdout == b"held\n", done.stderr


def events(worker: Worker, order: str, event: str) -> list[dict[str, Any]]:
    return [e for e in worker.events() if e["key"] == f"job:order:{order}" and e["event"] == event]


@pytest.mark.parametrize("transactional", [False, True], ids=["at_release", "record_success"])
def test_a_charge_killed_before_its_release_is_redelivered_with_the_same_idempotency_key(
    payments: PaymentsWorker, lock_url: str, transactional: bool
) -> None:
    """acks_late + reject_on_worker_lost: the child is SIGKILLed after the gateway charged
    (and, with record_success, after the ledger committed) and before its release; the
    message comes back at once. README: the success is kept only if it was written in the
    charge's transaction; else the body runs again, and the idempotency key, the same for
    the redelivery, makes the gateway charge once."""
    if transactional and not lock_url.startswith("postgresql"):
        pytest.skip("not applicable: record_success needs the Postgres store")
    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    if transactional:
        assert charges_of(lock_url, order) == []  # creates the table
    (payments.ledger.parent / f"kill-{order}").touch()
    answer = payments.tasks.charge.delay(order, "10.00", transactional).get(timeout=90)

    starts = events(payments, order, "start")
    charged = events(payments, order, "charged")
    assert len({start["id"] for start in starts}) == 1  # one task, redelivered
    assert len({start["idempotency_key"] for start in starts}) == 1
    calls = payments.gateway_calls(order)
    assert {call["key"] for call in calls} == {starts[0]["idempotency_key"]}
    assert answer == {"order": order, "reference": calls[0]["ref"]}
    outcomes = [record.outcome for record in payments.history(key)]
    assert outcomes[0] is Outcome.DISCONNECTED  # the killed child, taken over
    if transactional:
        assert len(starts) == 1 and len(calls) == 1  # the redelivery replayed the success
        assert charges_of(lock_url, order) == [calls[0]["ref"]]
        assert outcomes[1:] == [Outcome.SKIPPED]
    else:
        assert len(starts) == 2 and len(calls) == 2  # the body ran again: same key
        assert [c["reference"] for c in charged] == [calls[0]["ref"]] * 2
        assert outcomes[1:] == [Outcome.SUCCEEDED]
    kept = payments.store.last_success(key, "p.charge")
    assert kept is not None and kept.result == {"value": answer}
    # A later duplicate replays it: no third body, no third gateway call.
    assert payments.tasks.charge.delay(order, "10.00", transactional).get(timeout=60) == answer
    assert len(events(payments, order, "start")) == len(starts)


def test_the_janitor_prunes_a_charge_s_history_and_once_still_replays_it(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    """dlock_history_retention shorter than the charge's age: the janitor task prunes its
    records, and a duplicate still finds the success and replays it. A namespace of its own:
    the session's store has janitor runs of other tests, and an idle run within the hour of
    a recorded one prunes nothing."""
    namespace = f"prune{uuid.uuid4().hex[:6]}"
    worker = PaymentsWorker(
        tmp_path, redis_url, lock_url, DLOCK_TEST_RETENTION="0.001", DLOCK_TEST_NAMESPACE=namespace
    )
    worker.start()
    try:
        order = uuid.uuid4().hex[:8]
        key = f"{namespace}:order:{order}"
        first = worker.tasks.charge.delay(order, "5.00").get(timeout=60)
        assert [r.outcome for r in worker.history(key)] == [Outcome.SUCCEEDED]
        counts = worker.app.tasks["celery_dlock.janitor"].delay().get(timeout=60)
        assert counts["skipped"] == 0
        # The file store deletes whole days of history (README): today's stays.
        whole_days = lock_url.startswith("file")
        assert (counts["pruned"] == 0) if whole_days else (counts["pruned"] >= 1)
        before = [Outcome.SUCCEEDED] if whole_days else []
        assert [r.outcome for r in worker.history(key)] == before
        assert worker.tasks.charge.delay(order, "5.00").get(timeout=60) == first
        starts = [e for e in worker.events() if e["key"] == key and e["event"] == "start"]
        assert len(starts) == 1
        assert [r.outcome for r in worker.history(key)] == [*before, Outcome.SKIPPED]
    finally:
        worker.stop()


def test_a_taken_over_dead_charge_is_counted_in_the_metrics(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    """The killed child of an acks_late + reject_on_worker_lost task gets no signal: its
    redelivery takes its dead lease over, recorded ``disconnected`` in the history, before
    any janitor runs. The store counts that death as the janitor would, in
    ``dlock_reaped_total{reason="disconnected"}`` (README's alert on workers dying while
    holding counts it with ``dlock_releases_total{outcome="disconnected"}``)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {"DLOCK_TEST_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    worker = PaymentsWorker(tmp_path, redis_url, lock_url, **env).start()
    try:
        order = uuid.uuid4().hex[:8]
        (worker.ledger.parent / f"kill-{order}").touch()
        worker.tasks.charge.delay(order, "1.00").get(timeout=90)
        key = f"job:order:{order}"
        outcomes = [record.outcome for record in worker.history(key)]
        assert outcomes == [Outcome.DISCONNECTED, Outcome.SUCCEEDED]
    finally:
        worker.stop()
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = prometheus_client.CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
    }
    succeeded = (("outcome", "succeeded"), ("task", "p.charge"))
    assert samples.get(("dlock_releases_total", succeeded)) == 1
    deaths = samples.get(
        ("dlock_releases_total", (("outcome", "disconnected"), ("task", "p.charge"))), 0
    ) + samples.get(("dlock_reaped_total", (("reason", "disconnected"),)), 0)
    assert deaths == 1, {k: v for k, v in samples.items() if k[0].endswith("_total")}


def test_two_janitors_at_once_record_each_dead_lease_once(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    """Leases of a process that was SIGKILLed, and two janitor runs at the same moment (two
    beats): every lease is recorded once, and the runs' counts add up to them."""
    worker = PaymentsWorker(tmp_path, redis_url, lock_url).start(concurrency=4)
    try:
        prefix = f"job:dead:{uuid.uuid4().hex[:8]}"
        keys = [f"{prefix}:{n}" for n in range(150)]
        held_by_a_killed_process(lock_url, keys)
        janitor = worker.app.tasks["celery_dlock.janitor"]
        runs = [janitor.delay() for _ in range(2)]
        counts = [run.get(timeout=120) for run in runs]
        while worker.store.leases(prefix):  # a run that was skipped, or bounded: again
            counts.append(janitor.delay().get(timeout=120))
        records = [r for r in worker.store.history(limit=None) if r.key.startswith(prefix)]
        assert sorted(r.key for r in records) == sorted(keys)  # each once
        assert {r.outcome for r in records} == {Outcome.DISCONNECTED}
        assert sum(c["disconnected"] for c in counts) == len(keys)
    finally:
        worker.stop()


def test_the_first_success_wins_when_a_duplicate_overlapped_a_lost_lease(
    payments: PaymentsWorker, lock_url: str
) -> None:
    """README, once across a lost lease: the store ends the charge's lock session (here
    pg_terminate_backend) while its body waits after the gateway; a duplicate takes the key
    and runs (same idempotency key: the gateway charges once). The first body ends first:
    its release finds the lease gone, records ``lost`` and keeps its success. Then the
    duplicate ends, released normally (recorded ``succeeded`` with its result), and keeps
    no success of its own: "the first success wins; another holder's is never
    overwritten". A third submission replays the first body's result, the one its caller
    got."""
    if not lock_url.startswith("postgresql"):
        pytest.skip("not applicable: a lock session to end is Postgres's")
    from tests.support.services import lease_session_pids, postgres_admin

    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    gates = payments.ledger.parent
    first = payments.tasks.gated.delay(order, "10.00")
    [started] = eventually(lambda: events(payments, order, "start"), "the first body runs")
    with postgres_admin() as admin:
        [pid] = lease_session_pids(admin, lock_url.split("schema=")[1], started["fence"])
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    second = payments.tasks.gated.delay(order, "10.00")
    eventually(lambda: len(events(payments, order, "start")) == 2, "the duplicate runs")
    (gates / f"go-{order}-0").touch()
    answer = first.get(timeout=60)
    assert answer["n"] == 0
    (gates / f"go-{order}-1").touch()
    assert second.get(timeout=60)["n"] == 1
    calls = payments.gateway_calls(order)
    assert len(calls) == 2 and len({call["key"] for call in calls}) == 1

    ended = {r.lease.token: r.outcome for r in payments.history(key)}
    first_token, second_token = (e["token"] for e in events(payments, order, "start"))
    assert ended[first_token] is Outcome.LOST and ended[second_token] is Outcome.SUCCEEDED
    kept = payments.store.last_success(key, "p.gated")
    assert kept is not None and kept.lease.token == first_token, kept
    assert payments.tasks.gated.delay(order, "10.00").get(timeout=60) == answer


@pytest.mark.parametrize("rate", ["nan", "inf"])
def test_a_once_result_with_nan_or_infinity_is_replayed_as_none_and_frees_its_key(
    payments: PaymentsWorker, rate: str
) -> None:
    """Found by trying: Celery's json serializer sends NaN and Infinity, but the Postgres
    store refused the result at release (ConfigurationError): the task failed although its
    body had run, nothing was kept for once, and the lease stayed held by the child (every
    later run of the key found it busy). As for any value JSON cannot hold (README, once):
    the success is recorded, the key freed, duplicates replay None."""
    order = uuid.uuid4().hex[:8]
    key = f"job:quote:{order}"
    first = payments.tasks.quote.delay(order, float(rate)).get(timeout=60)
    assert first["order"] == order and str(first["rate"]) == rate
    assert payments.store.get(key) is None
    assert payments.tasks.quote.delay(order, 1.0).get(timeout=60) is None  # replayed
    assert [e["event"] for e in payments.events() if e["key"] == key] == ["start"]
    assert [r.outcome for r in payments.history(key)] == [Outcome.SUCCEEDED, Outcome.SKIPPED]
    kept = payments.store.last_success(key, "p.quote")
    assert kept is not None and kept.result == {"value": None, "unstored": "dict"}


def test_a_release_whose_result_the_store_refuses_still_frees_the_key(lock_url: str) -> None:
    """Lock.release(result=...) with a result the store cannot hold (Postgres: NaN) raises
    the ConfigurationError naming it, and releases the lease all the same, recorded without
    the result (the lease was detached first: it stayed held for the process's life)."""
    from celery_dlock import ConfigurationError, Lock, backend_from_url

    store = backend_from_url(lock_url)
    try:
        key = f"job:refused:{uuid.uuid4().hex[:8]}"
        lock = Lock(store, key)
        lease = lock.acquire()
        refused = {"rate": float("nan")}
        if lock_url.startswith("postgresql"):
            with pytest.raises(ConfigurationError, match="JSON"):
                lock.release(Outcome.SUCCEEDED, result=refused)
        else:  # the other stores keep it as Python's json writes it
            assert lock.release(Outcome.SUCCEEDED, result=refused) is not None
        assert store.get(key) is None
        [record] = store.history(key=key)
        assert record.lease.token == lease.token and record.outcome is Outcome.SUCCEEDED
    finally:
        store.close()


@pytest.fixture(scope="module")
def ledger_app() -> Iterator[tuple[Any, Any, str]]:
    """An eager app on a Postgres store of its own, with the app's ``charges`` table beside
    the store's tables, and a charge whose body says how it writes (``plan``)."""
    from celery import Celery

    from celery_dlock import LockedTask, backend_from_url, install
    from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin, with_options

    psycopg = pytest.importorskip("psycopg")
    admin = postgres_admin()
    schema = f"dlock_payments_{uuid.uuid4().hex[:8]}"
    url = with_options(POSTGRES_URL, schema=schema)
    store = backend_from_url(url)
    store.migrate()  # type: ignore[attr-defined]
    table = f'"{schema}".charges'
    admin.execute(f"CREATE TABLE {table} (order_id text, note text)")
    app = Celery("payments-ledger", set_as_current=False)
    app.conf.update(task_always_eager=True, dlock_backend=url)
    install(app, janitor=False)

    @app.task(
        shared=False,
        base=LockedTask,
        bind=True,
        name="l.charge",
        lock_key="order:{order}",
        once=True,
    )
    def charge(self: Any, order: str, plan: str) -> dict[str, Any]:
        result = {"order": order, "fence": self.lease.fence}
        if plan == "rolled_back":  # the ledger's transaction fails after record_success
            failing = pytest.raises(psycopg.errors.DivisionByZero)
            with failing, psycopg.connect(POSTGRES_URL) as conn:
                conn.execute(f"INSERT INTO {table} VALUES (%s, 'charge')", (order,))
                self.record_success(conn, result)
                conn.execute("SELECT 1 / 0")
            raise RuntimeError("the ledger is down")
        with psycopg.connect(POSTGRES_URL) as conn:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'charge')", (order,))
            self.record_success(conn, result)
            if plan == "twice_in_one_transaction":  # a helper that records it again
                self.record_success(conn, result)
        if plan == "then_a_receipt":  # a second transaction, recording the final result
            result = {**result, "receipt": True}
            with psycopg.connect(POSTGRES_URL) as conn:
                conn.execute(f"INSERT INTO {table} VALUES (%s, 'receipt')", (order,))
                self.record_success(conn, result)
        return result

    def notes(order: str) -> list[str]:
        rows = admin.execute(f"SELECT note FROM {table} WHERE order_id = %s", (order,))
        return sorted(str(row[0]) for row in rows.fetchall())

    try:
        yield charge, store, notes
    finally:
        store.close()
        drop_schema(admin, schema)
        admin.close()


def test_a_rolled_back_record_success_keeps_nothing_and_the_next_run_charges(
    ledger_app: tuple[Any, Any, Any],
) -> None:
    charge, store, notes = ledger_app
    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    with pytest.raises(RuntimeError, match="the ledger is down"):
        charge.apply((order, "rolled_back")).get()
    assert store.last_success(key, "l.charge") is None and notes(order) == []
    assert charge.apply((order, "once")).get()["order"] == order  # the body ran
    assert notes(order) == ["charge"]
    outcomes = [record.outcome for record in reversed(store.history(key=key))]
    assert outcomes == [Outcome.FAILED, Outcome.SUCCEEDED]


@pytest.mark.parametrize("plan", ["twice_in_one_transaction", "then_a_receipt"])
def test_record_success_twice_in_one_run_keeps_the_run_s_own_success(
    ledger_app: tuple[Any, Any, Any], plan: str
) -> None:
    """The run's own success is not "another success": recording it again (the same
    transaction, or a later one with the final result) must not roll the run's writes back
    nor turn the run into a replay of itself."""
    charge, store, notes = ledger_app
    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    result = charge.apply((order, plan)).get()
    assert notes(order) == (["charge"] if plan == "twice_in_one_transaction" else
                            ["charge", "receipt"])  # fmt: skip
    kept = store.last_success(key, "l.charge")
    assert kept is not None and kept.result == {"value": result}
    assert [record.outcome for record in store.history(key=key)] == [Outcome.SUCCEEDED]


def test_the_janitor_across_its_sessions_ended_by_the_server(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    """The store's sessions of the worker are ended by the server (pg_terminate_backend, as
    a failover or an idle-session killer does) between two janitor runs and while leases of
    a dead process wait: the next runs clear each of them once, and the janitor's own key
    is not left held."""
    if not lock_url.startswith("postgresql"):
        pytest.skip("not applicable: sessions the server ends are Postgres's")
    from tests.support.services import postgres_admin

    name = f"h6-janitor-{uuid.uuid4().hex[:8]}"
    url = f"{lock_url}&application_name={name}"
    worker = PaymentsWorker(tmp_path, redis_url, url).start(concurrency=2)
    janitor = worker.app.tasks["celery_dlock.janitor"]
    try:
        prefix = f"job:dead:{uuid.uuid4().hex[:8]}"
        keys = [f"{prefix}:{n}" for n in range(40)]
        for _ in range(2):  # both children have their sessions
            assert janitor.delay().get(timeout=60)["skipped"] == 0
        held_by_a_killed_process(lock_url, keys)
        with postgres_admin() as admin:
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name LIKE %s",
                (f"{name}%",),
            ).fetchall()
        assert ended and all(row[0] for row in ended)
        counts: list[dict[str, int]] = []
        failures: list[str] = []
        for _ in range(4):
            try:
                counts.append(janitor.delay().get(timeout=60))
            except Exception as exc:  # a run on a session that just ended: said, not hidden
                failures.append(f"{type(exc).__name__}: {exc}")
            if not worker.store.leases(prefix):
                break
        assert worker.store.leases(prefix) == [], failures
        records = [r for r in worker.store.history(limit=None) if r.key.startswith(prefix)]
        assert sorted(r.key for r in records) == sorted(keys)
        assert sum(c["disconnected"] for c in counts) == len(keys)
        assert worker.store.get("job:celery_dlock.janitor") is None
    finally:
        worker.stop()


def test_an_order_id_given_as_a_float_locks_the_key_of_the_same_int() -> None:
    """A JSON client sends ``42.0`` where another sends ``42``: the same order, so the same
    key, the same once memory and the same idempotency key (Decimal("42.0") renders 42)."""
    from decimal import Decimal

    from celery import Celery

    from celery_dlock import LockedTask

    app = Celery("payments-keys", set_as_current=False)
    app.conf.update(task_always_eager=True, dlock_backend="memory://payments-keys")

    @app.task(shared=False, base=LockedTask, name="k.charge", lock_key="order:{order_id}")
    def charge(order_id: Any) -> None:
        return None

    keys = {charge.lock_key_for((value,)) for value in (42, Decimal("42.0"), 42.0)}
    assert keys == {"job:order:42"}


def test_a_success_whose_release_outlived_an_outage_is_kept_when_the_janitor_came_first(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    """README: "A body that returned is always remembered", also while the store is
    unreachable (the release is tried again with backoff). Here the outage (a proxy that
    cuts the worker off Postgres) ends the charge's lock session; the janitor, which still
    reaches the store, records the dead lease ``disconnected`` while the release waits.
    When the store answers again, the release must keep the success for once (and record
    ``lost``), so that the duplicate replays it. Before: the retried release took the
    janitor's record for its own landed attempt, kept nothing, and the duplicate charged
    again."""
    if not lock_url.startswith("postgresql"):
        pytest.skip("not applicable: a session the outage ends is Postgres's")
    from celery_dlock import backend_from_url
    from celery_dlock.reap import reap
    from tests.support.countingproxy import CountingProxy

    direct = backend_from_url(lock_url)
    with CountingProxy("127.0.0.1", 5432) as proxy:
        url = lock_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        worker = PaymentsWorker(tmp_path, redis_url, url).start()
        try:
            order = uuid.uuid4().hex[:8]
            key = f"job:order:{order}"
            first = worker.tasks.gated.delay(order, "25.00")
            [started] = eventually(lambda: events(worker, order, "start"), "the body runs")
            proxy.refuse()  # the outage: the lock session ends with its connection
            (worker.ledger.parent / f"go-{order}-0").touch()
            eventually(
                lambda: "could not store the success" in worker.log.read_text(),
                "the release fails and waits to try again",
            )
            reaped = eventually(lambda: reap(direct)["disconnected"], "the janitor's run")
            assert reaped == 1
            proxy.accept()
            answer = first.get(timeout=90)
            kept = direct.last_success(key, "p.gated")
            assert kept is not None and kept.lease.token == started["token"]
            ended = {
                r.outcome for r in direct.history(key=key) if r.lease.token == kept.lease.token
            }
            assert ended == {Outcome.DISCONNECTED, Outcome.LOST}
            assert worker.tasks.gated.delay(order, "25.00").get(timeout=60) == answer
            assert len(events(worker, order, "start")) == 1  # charged once
        finally:
            proxy.accept()
            worker.stop()
            direct.close()
