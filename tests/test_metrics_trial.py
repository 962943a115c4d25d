"""An operator's trial of the Prometheus metrics, against real stores: what a metrics
directory that is missing or vanishes does to locking, whether a lost lease reaches the
alert the README suggests, hostile task names as label values, keys kept out of labels,
exact counts under threads (in one process and in multiprocess mode), and enable/disable
called twice.

Every test runs its metrics in a fresh interpreter (``tests.support.trialtools_metrics``):
the metrics of a process are made once, so turning them on here would change what the
other metrics tests see.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin, with_options
from tests.support.trialtools_metrics import run_snippet

pytest.importorskip("prometheus_client")

REDIS_URL = os.environ.get("DLOCK_TRIAL_REDIS_URL", "redis://127.0.0.1:6379/4")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh schema on the test Postgres, dropped afterwards."""
    admin = postgres_admin()
    schema = f"dlock_mtrial_{os.urandom(5).hex()}"
    try:
        yield with_options(POSTGRES_URL, schema=schema)
    finally:
        drop_schema(admin, schema)
        admin.close()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A fresh key prefix on the test Redis, its keys deleted afterwards."""
    from tests.support.services import redis_client

    prefix = f"dlock-mtrial-{os.urandom(5).hex()}"
    client = redis_client(REDIS_URL)
    try:
        yield f"{REDIS_URL}?prefix={prefix}"
    finally:
        for name in client.scan_iter(match=f"*{prefix}*", count=1000):
            client.delete(name)
        client.close()


# -- a metrics directory that is missing or vanishes ------------------------------------------

MISSING_DIRECTORY = """
    import json, sys
    from celery_dlock import Holder, Lock, metrics
    from celery_dlock.backends.file import FileBackend

    metrics.enable()
    backend = FileBackend(sys.argv[1])
    lock = Lock(backend, "job:trial:nodir", holder=Holder.current(task_name="t.nodir"))
    out = {"error": None}
    try:
        lock.acquire()
        lock.release()
    except Exception as exc:
        out["error"] = repr(exc)
    # What another worker sees now, while this process (the holder) still runs.
    out["held"] = backend.get("job:trial:nodir") is not None
    print(json.dumps(out))
"""


def test_a_missing_metrics_directory_never_leaves_a_key_held(tmp_path: Path) -> None:
    """An operator sets ``PROMETHEUS_MULTIPROC_DIR`` to a directory that is not there (a
    typo, a tmpfs not mounted yet). Metrics may then be lost, but locking must go on: a
    Lock that was acquired and released leaves its key free, and whatever fails must not
    leave the key held by a live process that nobody will release it for."""
    out = run_snippet(
        MISSING_DIRECTORY,
        str(tmp_path / "locks"),
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "no-such-directory")},
    )
    assert out["held"] is False, out


VANISHING_DIRECTORY = """
    import json, shutil, sys
    from celery_dlock import Holder, Lock, Outcome, metrics
    from celery_dlock.backends.file import FileBackend

    metrics.enable()
    backend = FileBackend(sys.argv[1])
    lock = Lock(backend, "job:trial:vanish", holder=Holder.current(task_name="t.vanish"))
    lock.acquire()
    shutil.rmtree(sys.argv[2])  # a tmp cleaner, a restarted container's tmpfs
    out = {"error": None}
    try:
        record = lock.release()
        out["outcome"] = None if record is None else record.outcome.value
    except Exception as exc:
        out["error"] = repr(exc)
    out["history"] = [r.outcome.value for r in backend.history(key="job:trial:vanish")]
    print(json.dumps(out))
"""


def test_a_metrics_directory_removed_while_held_does_not_fail_the_release(
    tmp_path: Path,
) -> None:
    """The metrics directory disappears while a task holds its key. The release still
    happens in the store and is recorded ``succeeded``; the caller, whose work succeeded,
    must not get an exception from the metrics for it."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    out = run_snippet(
        VANISHING_DIRECTORY,
        str(tmp_path / "locks"),
        str(directory),
        env={"PROMETHEUS_MULTIPROC_DIR": str(directory)},
    )
    assert out["history"] == ["succeeded"], out
    assert out["error"] is None, out
    assert out["outcome"] == "succeeded", out


# -- a lease lost while held ------------------------------------------------------------------

LOST_WHILE_HELD = """
    import json, sys, time
    from prometheus_client import CollectorRegistry
    from celery_dlock import Holder, Lock, Outcome, backend_from_url, metrics

    registry = CollectorRegistry()
    metrics.enable(registry)
    url = sys.argv[1]
    backend = backend_from_url(url)
    if hasattr(backend, "migrate"):
        backend.migrate()
    operator = backend_from_url(url)
    lock = Lock(backend, "job:trial:lost", holder=Holder.current(task_name="t.lost"))
    lock.acquire()
    # An operator's `celery-dlock release --force` while the task runs.
    lease = operator.get("job:trial:lost")
    operator.release(lease, Outcome.FORCED, "forced", "trial")
    time.sleep(2.5)  # the task goes on working a while
    lock.release()
    print(json.dumps({
        "lost": registry.get_sample_value("dlock_leases_lost_total", {"task": "t.lost"}) or 0,
        "released_lost": registry.get_sample_value(
            "dlock_releases_total", {"task": "t.lost", "outcome": "lost"}) or 0,
        "history": sorted(r.outcome.value for r in operator.history(key="job:trial:lost")),
    }))
"""


@pytest.mark.parametrize("store", ["file", "postgres"])
def test_a_lease_lost_while_held_reaches_the_lost_lease_alert(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A lease force-released while its task runs was lost while held, whatever the store:
    the README's alert ``increase(dlock_leases_lost_total[10m]) > 0`` must fire for it,
    once, and the release is counted ``lost`` once, as the history records it."""
    url = f"file://{tmp_path}/locks" if store == "file" else request.getfixturevalue("pg_url")
    out = run_snippet(LOST_WHILE_HELD, url)
    assert out["history"] == ["forced", "lost"], out
    assert out["released_lost"] == 1, out
    assert out["lost"] == 1, out


# -- label values -----------------------------------------------------------------------------

HOSTILE_NAMES = """
    import json, os, sys
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from celery_dlock import Holder, Lock, metrics
    from celery_dlock.backends.file import FileBackend

    names = json.loads(sys.argv[2])
    multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    registry = CollectorRegistry()
    metrics.enable(None if multiprocess else registry)
    backend = FileBackend(sys.argv[1])
    for n, name in enumerate(names):
        lock = Lock(backend, f"job:trial:name:{n}", holder=Holder.current(task_name=name))
        lock.acquire()
        lock.release()
    if multiprocess:
        metrics.collector(registry)
    text = generate_latest(registry).decode("utf-8")
    seen = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dlock_releases_total":
                seen[sample.labels["task"]] = sample.value
    print(json.dumps({"seen": seen}))
"""

HOSTILE = [
    'quote " and \\\\ backslash',
    "new\nline and } brace",
    "</script><script>alert(1)</script>",
    "ünïcödé ✓ 漢字",
    "x" * 5000,
    "",
]


@pytest.mark.parametrize("mode", ["single", "multiprocess"])
def test_hostile_task_names_round_trip_as_label_values(tmp_path: Path, mode: str) -> None:
    """Task names with quotes, backslashes, newlines, HTML, non-ASCII text, 5,000
    characters, or none: the exposition stays parseable by Prometheus's own parser and
    each name comes back as its own series with its count, in one process and summed from
    a multiprocess directory."""
    import json

    env = {}
    if mode == "multiprocess":
        directory = tmp_path / "prometheus"
        directory.mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    out = run_snippet(HOSTILE_NAMES, str(tmp_path / "locks"), json.dumps(HOSTILE), env=env)
    assert out["seen"] == dict.fromkeys(HOSTILE, 1.0)


KEYS_NOT_LABELS = """
    import json, sys
    from prometheus_client import CollectorRegistry
    from celery_dlock import Holder, Lock, Outcome, metrics
    from celery_dlock.backends.file import FileBackend
    from celery_dlock.reap import reap

    registry = CollectorRegistry()
    metrics.enable(registry)
    backend = FileBackend(sys.argv[1])

    def series():
        return sorted(
            (s.name, tuple(sorted(s.labels.items())))
            for family in registry.collect() for s in family.samples
        )

    def burst(first, count):
        for n in range(first, first + count):
            lock = Lock(backend, f"job:trial:order:{n}",
                        holder=Holder.current(task_name="shop.charge"))
            lock.acquire()
            lock.release(Outcome.FAILED if n % 2 else Outcome.SUCCEEDED, "E", "d")

    burst(0, 10)
    before = series()
    burst(10, 500)
    after = series()
    labels = {v for _, labels in after for _, v in labels}
    print(json.dumps({"before": len(before), "after": len(after),
                      "keyish": sorted(v for v in labels if "order" in v)}))
"""


def test_keys_never_become_label_values(tmp_path: Path) -> None:
    """Five hundred more keys of the same task add no series: no key (an order id) is ever a
    label value, so a busy store cannot blow up Prometheus's cardinality."""
    out = run_snippet(KEYS_NOT_LABELS, str(tmp_path / "locks"))
    assert out["keyish"] == []
    assert out["after"] == out["before"]


# -- counts under threads, and enable/disable twice --------------------------------------------

THREADS = """
    import json, os, sys, threading
    from prometheus_client import CollectorRegistry
    from celery_dlock import Holder, Lock, backend_from_url, metrics

    multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    registry = CollectorRegistry()
    metrics.enable(None if multiprocess else registry)
    backend = backend_from_url(sys.argv[1])
    if hasattr(backend, "migrate"):
        backend.migrate()
    threads, each = 8, 40
    start = threading.Barrier(threads)

    def work(t):
        start.wait()
        for n in range(each):
            key = f"job:trial:threads:{n % 3}"
            lock = Lock(backend, key, holder=Holder.current(task_name=f"t.thread{t % 2}"),
                        wait=60)
            lock.acquire()
            lock.release()

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if multiprocess:
        metrics.collector(registry)
    get = registry.get_sample_value
    print(json.dumps({
        "releases": [get("dlock_releases_total", {"task": f"t.thread{i}",
                                                 "outcome": "succeeded"}) for i in (0, 1)],
        "held": [get("dlock_held_seconds_count", {"task": f"t.thread{i}",
                                                 "outcome": "succeeded"}) for i in (0, 1)],
        "waits": [get("dlock_wait_seconds_count", {"task": f"t.thread{i}"}) for i in (0, 1)],
        "history": len(backend.history(key=None, limit=None)),
    }))
"""


@pytest.mark.parametrize("mode", ["single", "multiprocess"])
def test_counts_are_exact_under_contending_threads(
    mode: str, tmp_path: Path, redis_url: str
) -> None:
    """Eight threads, 40 lock cycles each on three contended keys of a real Redis: every
    release is counted once, with its hold time and its wait, split by task exactly as the
    history records them; the same in multiprocess mode."""
    env = {}
    if mode == "multiprocess":
        directory = tmp_path / "prometheus"
        directory.mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    out = run_snippet(THREADS, redis_url, env=env)
    assert out["history"] == 320
    assert out["releases"] == [160.0, 160.0]
    assert out["held"] == [160.0, 160.0]
    assert out["waits"] == [160.0, 160.0]


TWICE = """
    import json, sys
    from prometheus_client import CollectorRegistry, REGISTRY
    from celery_dlock import Holder, Lock, metrics
    from celery_dlock.backends.file import FileBackend

    backend = FileBackend(sys.argv[1])

    def cycle():
        lock = Lock(backend, "job:trial:twice", holder=Holder.current(task_name="t.twice"))
        lock.acquire()
        lock.release()

    def count():
        return REGISTRY.get_sample_value(
            "dlock_releases_total", {"task": "t.twice", "outcome": "succeeded"}) or 0

    steps = []
    metrics.enable(); metrics.enable()
    cycle(); steps.append([metrics.enabled(), count()])
    metrics.disable(); metrics.disable()
    cycle(); steps.append([metrics.enabled(), count()])
    metrics.enable()
    cycle(); steps.append([metrics.enabled(), count()])
    print(json.dumps({"steps": steps}))
"""


def test_enable_and_disable_twice_keep_one_set_of_counts(tmp_path: Path) -> None:
    """``enable()`` twice registers nothing twice (no duplicate-timeseries error);
    ``disable()`` twice stops counting and keeps the values; enabled again, counting goes
    on from them."""
    out = run_snippet(TWICE, str(tmp_path / "locks"))
    assert out["steps"] == [[True, 1.0], [False, 1.0], [True, 2.0]]
