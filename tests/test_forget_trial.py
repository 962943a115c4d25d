# ruff: noqa: F811
"""An adversarial trial of ``forget`` (what undoes a success that ``once`` keeps), as a
payments operator would try it, on real stores: forget racing a run that succeeds, another
forget, a stale token, the janitor's pruning, the duplicates that follow it, odd keys and a
store that fails under it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery

from celery_dlock import Holder, LockedTask, Outcome, forget, install
from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.file import history as file_history
from celery_dlock.errors import BackendError, LockKeyError
from celery_dlock.records import DETAILS_LIMIT, Lease, Record
from tests.backends.storecase import StoreCase

# The Redis tests' fixtures and helpers for a connection that loses a reply (F811).
from tests.backends.test_redis import lossy, open_backend, prefix, via  # noqa: F401
from tests.support.countingproxy import CountingProxy

# ``case`` is the janitor trial's fixture: the tests name it as a parameter (F811).
from tests.test_janitor_trial import case, stores  # noqa: F401

TASK = "forgettrial.charge"
#: Every store, the Redis Cluster, SeaweedFS's S3 and Postgres through PgBouncer included.
ALL = [
    "file", "gcs", "memory", "postgres", "postgres_ttl", "redis", "redis_cluster", "s3",
    "s3-seaweedfs",
]  # fmt: skip
OBJECT_STORES = ["gcs", "s3", "s3-seaweedfs"]
#: The stores a Celery app reaches by URL (memory lives in one backend object).
BY_URL = [name for name in ALL if name != "memory"]


def new_key() -> str:
    return f"job:forgettrial:{uuid.uuid4().hex[:10]}"


def holder(task: str = TASK) -> Holder:
    return Holder.current(task_name=task, task_id=f"t-{uuid.uuid4().hex[:6]}")


def succeed(backend: LockBackend, key: str, result: Any, task: str = TASK) -> Record:
    """A run of ``task`` on ``key`` that takes the key and releases it as a success."""
    lease = backend.try_acquire(key, holder(task), 60.0)
    assert lease is not None
    record = backend.release(lease, Outcome.SUCCEEDED, None, None, result)
    assert record is not None
    return record


def kept(backend: LockBackend, key: str, task: str = TASK) -> str | None:
    """The token of the lease whose success is kept for ``task`` on ``key``."""
    found = backend.last_success(key, task)
    return None if found is None else found.lease.token


def forgotten_records(backend: LockBackend, key: str) -> list[Record]:
    return backend.history(key=key, outcome=Outcome.FORGOTTEN, limit=None)


def run_together(*targets: Callable[[], Any]) -> list[Any]:
    """Run ``targets`` in threads started at once; their results, in order."""
    start = threading.Barrier(len(targets))
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        start.wait()
        try:
            results[index] = targets[index]()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return results


# -- races ---------------------------------------------------------------------------------------


def after_first_write(
    monkeypatch: pytest.MonkeyPatch, backend: LockBackend, then: Callable[[], Any]
) -> list[Any]:
    """Call ``then`` once, right after the object store's first write of those a forget
    makes (a delete of a ``success/`` object or a swap of the lock object, whichever comes
    first); the list its answer goes in."""
    answers: list[Any] = []

    def once_after(write: Callable[..., Any]) -> Callable[..., Any]:
        def wrote(*args: Any, **kwargs: Any) -> Any:
            done = write(*args, **kwargs)
            if not answers:
                answers.append(None)  # a write by ``then`` itself calls nothing
                answers[0] = then()
            return done

        return wrote

    store = backend.store()  # type: ignore[attr-defined]
    monkeypatch.setattr(store, "delete_if", once_after(store.delete_if))
    objects = backend.objects  # type: ignore[attr-defined]
    monkeypatch.setattr(objects, "write_state", once_after(objects.write_state))
    return answers


@stores(*OBJECT_STORES)
def test_a_success_released_while_forget_is_between_its_writes_is_not_the_forgotten_one(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose lease outlived an earlier one (that one's success kept by ``remember``)
    succeeds while ``forget`` has swapped the success out of the lock object but not yet
    deleted its ``success/`` object: the release must not carry the forgotten success back
    into the lock object. Afterwards the key keeps nothing (the release came first: the
    forgotten success was kept then) or the new run's success; never the forgotten one."""
    backend, key = case.backend, new_key()
    first = succeed(backend, key, {"charged": 1})
    running = backend.try_acquire(key, holder(), 60.0)
    assert running is not None
    landed = after_first_write(
        monkeypatch,
        backend,
        lambda: backend.release(running, Outcome.SUCCEEDED, None, None, {"c": 2}),
    )
    assert backend.forget_success(key, TASK, first.lease.token) is True
    monkeypatch.undo()
    assert landed and landed[0] is not None
    assert kept(backend, key) != first.lease.token
    assert kept(case.second(), key) in (None, running.token)


@stores(*OBJECT_STORES)
def test_a_forget_coming_between_another_s_two_writes_does_not_forget_it_again(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two operators forget the same success; the second comes in whole after the first
    one's first write: exactly one of them forgets it (and so writes the record)."""
    backend, other, key = case.backend, case.second(), new_key()
    first = succeed(backend, key, {"charged": 1})
    theirs = after_first_write(
        monkeypatch, backend, lambda: other.forget_success(key, TASK, first.lease.token)
    )
    ours = backend.forget_success(key, TASK, first.lease.token)
    monkeypatch.undo()
    assert sorted([ours, *theirs]) == [False, True]
    assert backend.last_success(key, TASK) is None
    other.close()


@stores(*OBJECT_STORES)
def test_a_release_that_read_the_success_before_forget_does_not_carry_it_back(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The success forgotten lives only under ``success/`` (a lost lease's ``remember``).
    The running run's release reads it there (its create-if-absent refused) and forget
    comes in whole before the release swaps its lock object: the swap must not carry the
    forgotten success into the lock object."""
    backend, other, key = case.backend, case.second(), new_key()
    first, running = lost_and_kept(case, key)
    objects = other.objects  # type: ignore[attr-defined]
    read = objects.read
    forgot: list[bool] = []

    def read_then_forgotten(name: str) -> Any:
        found = read(name)
        if "/success/" in f"/{name}" and not forgot:
            forgot.append(backend.forget_success(key, TASK, first.lease.token))
        return found

    monkeypatch.setattr(objects, "read", read_then_forgotten)
    released = release_retried(other, running)
    monkeypatch.undo()
    assert forgot == [True] and released is not None
    assert kept(backend, key) != first.lease.token
    other.close()


def forgotten_and_kept_anew(
    other: LockBackend, key: str, first: Record, newer: list[Record]
) -> None:
    """Another operator forgets ``first`` and a new run keeps its own success; ``newer``
    gets the old record (first: the patched reads of these calls then pass through) and
    the new one."""
    newer.append(first)
    assert other.forget_success(key, TASK, first.lease.token) is True
    newer.append(succeed(other, key, {"charged": 2}))


def test_a_new_success_kept_between_another_forget_and_this_one_stays(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two operators forget the same success on the file store; between the first one's
    unlink and the second one's, a new run keeps its success (a new charge). The second
    forget read the old success: it must not remove the new one, or the next duplicate
    charges a third time."""
    from celery_dlock.backends.file import FileBackend

    backend, other = FileBackend(str(tmp_path / "locks")), FileBackend(str(tmp_path / "locks"))
    key = new_key()
    first = succeed(backend, key, {"charged": 1})
    read = file_history.read_success
    newer: list[Record] = []

    def stale_read(path: str) -> Record | None:
        found = read(path)
        if not newer:  # the other operator and the new run come in after this read
            forgotten_and_kept_anew(other, key, first, newer)
        return found

    monkeypatch.setattr(file_history, "read_success", stale_read)
    assert backend.forget_success(key, TASK, first.lease.token) is False
    monkeypatch.undo()
    assert kept(backend, key) == newer[1].lease.token
    backend.close()
    other.close()


@stores("s3", "s3-seaweedfs")  # fake-gcs-server deletes whatever ifGenerationMatch says
def test_a_new_success_kept_after_another_forget_stays_on_object_stores(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on the file store: this forget has read the ``success/`` object of the old
    success when another operator forgets it and a new run keeps its own. The delete by
    version (and the swap) must leave the new success kept."""
    backend, other, key = case.backend, case.second(), new_key()
    first = succeed(backend, key, {"charged": 1})
    objects = backend.objects  # type: ignore[attr-defined]
    read = objects.read
    newer: list[Record] = []

    def stale_read(name: str) -> Any:
        found = read(name)
        if "/success/" in f"/{name}" and not newer:
            forgotten_and_kept_anew(other, key, first, newer)
        return found

    monkeypatch.setattr(objects, "read", stale_read)
    assert backend.forget_success(key, TASK, first.lease.token) is False
    monkeypatch.undo()
    assert len(newer) == 2, "the forget read no success/ object"
    assert kept(backend, key) == newer[1].lease.token
    other.close()


def lost_and_kept(case: StoreCase, key: str) -> tuple[Record, Lease]:
    """A run whose lease was lost (force-released) while a second run took the key; the
    first keeps its success afterwards (``remember``, first wins) and the second still
    holds the key: the state an operator forgets in while a run is going on."""
    backend = case.backend
    lost = backend.try_acquire(key, holder(), 60.0)
    assert lost is not None
    assert backend.release(lost, Outcome.FORCED, "forced", "trial") is not None
    running = backend.try_acquire(key, holder(), 60.0)
    assert running is not None
    success = Record(lost, time.time(), Outcome.SUCCEEDED, None, None, {"charged": 1})
    assert backend.remember(success) is True
    assert kept(backend, key) == lost.token
    return success, running


def release_retried(backend: LockBackend, running: Lease) -> Record | None:
    """The success of ``running`` released as ``once`` releases one: a store error is tried
    again (``releasing.release_success``)."""
    try:
        return backend.release(running, Outcome.SUCCEEDED, None, None, {"charged": 2})
    except BackendError:
        return backend.release(running, Outcome.SUCCEEDED, None, None, {"charged": 2})


@stores(*ALL)
def test_forget_racing_the_release_of_a_running_run_never_leaves_the_forgotten_success(
    case: StoreCase,
) -> None:
    """``forget`` and the success of the run holding the key, at once, several times: the
    forgotten success is gone, exactly one ``forgotten`` record names it, and what is kept
    is nothing or the running run's success (as if the release came first or second)."""
    backend, other = case.backend, case.second()
    for _ in range(4):
        key = new_key()
        first, running = lost_and_kept(case, key)
        record, released = run_together(
            lambda key=key: forget(backend, key, TASK, reason="refund 1", by="ops"),
            lambda running=running: release_retried(other, running),
        )
        assert record is not None and released is not None
        assert f"kept by fence {first.fence}" in (record.details or "")
        assert kept(backend, key) in (None, running.token)
        assert [r.lease.token for r in forgotten_records(backend, key)] == [record.lease.token]
    if other is not backend:
        other.close()


@stores(*OBJECT_STORES)
def test_a_release_whose_first_success_create_meets_a_forget_keeps_its_success(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The success forgotten lives only under ``success/`` (a lost lease's ``remember``);
    the running run's release finds it there (its create-if-absent refused) and the forget
    deletes it before the release reads it: the release keeps its own success (it raised
    "was there, then gone")."""
    backend, other, key = case.backend, case.second(), new_key()
    first, running = lost_and_kept(case, key)
    objects = backend.objects  # type: ignore[attr-defined]
    create = objects.create

    forgets: list[bool] = []

    def refused_then_forgotten(name: str, body: bytes) -> Any:
        written = create(name, body)
        if written.version is None and "/success/" in f"/{name}" and not forgets:
            forgets.append(other.forget_success(key, TASK, first.lease.token))
        return written

    monkeypatch.setattr(objects, "create", refused_then_forgotten)
    record = backend.release(running, Outcome.SUCCEEDED, None, None, {"charged": 2})
    monkeypatch.undo()
    assert forgets == [True]
    assert record is not None
    assert kept(backend, key) == running.token
    other.close()


#: fake-gcs-server deletes whatever ifGenerationMatch says, so two forgets can both delete.
@stores(*[name for name in ALL if name != "gcs"])
def test_concurrent_forgets_forget_once_and_record_once(case: StoreCase) -> None:
    """Four operators forget the same success at once, each through a client of its own:
    one forgets it and records it, the others change nothing; the next success is kept."""
    backend, key = case.backend, new_key()
    first = succeed(backend, key, {"charged": 1})
    clients = [case.second() for _ in range(4)]
    results = run_together(
        *[
            lambda b=b: forget(b, key, TASK, reason="twice", token=first.lease.token)
            for b in clients
        ]
    )
    done = [r for r in results if r is not None]
    assert len(done) == 1
    assert [r.lease.token for r in forgotten_records(backend, key)] == [done[0].lease.token]
    assert backend.last_success(key, TASK) is None
    second = succeed(backend, key, {"charged": 2})
    assert kept(backend, key) == second.lease.token
    for client in clients:
        if client is not backend:
            client.close()


@stores("file", "postgres")
def test_the_record_says_when_the_success_was_released_in_any_time_zone(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``forgotten`` record is an audit entry read on other hosts: the release time of
    the success it names carries its offset (the same instant whatever ``TZ`` the
    forgetting process had), not a local wall-clock time."""
    backend, key = case.backend, new_key()
    first = succeed(backend, key, {"charged": 1})
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        record = forget(backend, key, TASK, reason="audit")
    finally:
        monkeypatch.undo()
        time.tzset()
    assert record is not None
    released = datetime.fromtimestamp(first.released_at, timezone.utc)
    assert f"released {released.isoformat(' ', 'seconds')})" in (record.details or "")


@stores(*ALL)
def test_a_long_reason_is_bounded_as_every_record_s_details_are(case: StoreCase) -> None:
    """An operator pastes a whole ticket as the reason: the record's details are bounded
    (``DETAILS_LIMIT`` bytes, its head and tail kept) like every record's, and the store
    keeps the record as it was returned (Postgres cut it on its own before)."""
    backend, key = case.backend, new_key()
    first = succeed(backend, key, {"charged": 1})
    reason = "ticket 881: " + "é" * 50_000 + " END"
    record = forget(backend, key, TASK, reason=reason)
    assert record is not None and record.details is not None
    assert len(record.details.encode()) <= DETAILS_LIMIT
    assert record.details.startswith(f"the success of {TASK} kept by fence {first.fence}")
    assert record.details.endswith(" END")
    [stored] = forgotten_records(backend, key)
    assert stored.details == record.details


@stores(*ALL)
def test_a_stale_token_forgets_nothing_and_records_nothing(case: StoreCase) -> None:
    """An operator was shown the first success; meanwhile it was forgotten and a new run
    (a new charge) kept its own. Forgetting by the shown token leaves the new one."""
    backend, key = case.backend, new_key()
    shown = succeed(backend, key, {"charged": 1})
    assert forget(backend, key, TASK, reason="first") is not None
    newer = succeed(backend, key, {"charged": 2})
    assert forget(backend, key, TASK, reason="stale", token=shown.lease.token) is None
    assert kept(backend, key) == newer.lease.token
    assert len(forgotten_records(backend, key)) == 1


@stores(*ALL)
def test_forget_of_a_success_whose_history_was_pruned(case: StoreCase) -> None:
    """The janitor pruned the key's history (retention) but ``once`` still keeps the
    success: forget forgets it, records it, and the next success is kept anew."""
    backend, key = case.backend, new_key()
    first = succeed(backend, key, {"charged": 1})
    backend.prune_history(time.time() + 1.0)  # the file store prunes whole days only
    assert kept(backend, key) == first.lease.token
    record = forget(backend, key, TASK, reason="pruned")
    assert record is not None and f"kept by fence {first.fence}" in (record.details or "")
    assert backend.last_success(key, TASK) is None
    assert len(forgotten_records(backend, key)) == 1
    second = succeed(backend, key, {"charged": 2})
    assert kept(backend, key) == second.lease.token


@stores(*ALL)
def test_forget_of_a_replacement_chain_and_a_second_forget_of_it(case: StoreCase) -> None:
    """A sync that replaced itself over three pages: forget takes the first run's success
    and every page's; a second forget finds nothing and writes nothing."""
    backend, key = case.backend, new_key()
    head = succeed(backend, key, {"value": None, "replaced": {"nesting": 1, "itself": True}})
    pages = [
        succeed(backend, key, {"value": n}, task=f"{TASK} (replacement {n})") for n in (1, 2, 3)
    ]
    record = forget(backend, key, TASK, reason="resync")
    assert record is not None
    names = ", ".join(f"{TASK} (replacement {n})" for n in (1, 2, 3))
    assert f"and those of {names} forgotten" in (record.details or "")
    for page in pages:
        assert kept(backend, key, page.lease.holder.task_name or "") is None
    assert kept(backend, key) is None and head.lease.token not in {kept(backend, key)}
    assert forget(backend, key, TASK) is None
    assert len(forgotten_records(backend, key)) == 1


@stores("file", *OBJECT_STORES)
def test_forget_of_a_key_whose_state_was_collected(case: StoreCase) -> None:
    """The key was idle past ``gc_after`` and the janitor collected its per-key state (the
    lock object, the lock file); ``once`` still keeps its success: forget forgets it, and
    the key's next success is kept, with a fence above the collected ones."""
    from celery_dlock import backend_from_url

    assert case.url is not None
    joiner = "&" if "?" in case.url else "?"
    backend = backend_from_url(f"{case.url}{joiner}gc_after=0")
    key = new_key()
    first = succeed(backend, key, {"charged": 1})
    time.sleep(1.1)  # a second on the server's clock (object stores' Date is whole seconds)
    backend.reap()
    assert backend.get(key) is None and kept(backend, key) == first.lease.token
    if case.backend.__class__.__name__ != "FileBackend":  # the lock object is gone
        layout = backend.layout  # type: ignore[attr-defined]
        assert backend.objects.read(layout.lock(key)).body is None  # type: ignore[attr-defined]
    record = forget(backend, key, TASK, reason="collected")
    assert record is not None and backend.last_success(key, TASK) is None
    second = succeed(backend, key, {"charged": 2})
    assert kept(backend, key) == second.lease.token and second.fence > first.fence
    backend.close()


ODD_KEYS = [
    "job:forgettrial:a/b",
    "job:forgettrial:a%2Fb",
    "job:forgettrial:../..",
    "job:forgettrial:ü ñ 42 %2F?#*",
    "job:forgettrial:" + "x" * 100,
    "job:forgettrial:a\\b'c\"d;--",
    "job:forgettrial:日本語:注文",
]


@stores(*ALL)
def test_odd_keys_and_task_names_are_forgotten_alone(case: StoreCase) -> None:
    """Keys with spaces, escapes, quotes, non-ASCII and length, and task names with
    spaces: each success is forgotten on its own key, the others stay."""
    backend = case.backend
    task = "forgettrial.charge (eu) ünïcode"
    firsts = {key: succeed(backend, key, {"key": key}, task=task) for key in ODD_KEYS}
    assert forget(backend, ODD_KEYS[0], task, reason="odd") is not None
    assert kept(backend, ODD_KEYS[0], task) is None
    for key in ODD_KEYS[1:]:
        assert kept(backend, key, task) == firsts[key].lease.token
        assert forget(backend, key, task) is not None
        assert kept(backend, key, task) is None


@stores("file", "memory", "redis")
def test_a_bad_key_or_an_unknown_task_is_said_clearly(case: StoreCase) -> None:
    backend, key = case.backend, new_key()
    first = succeed(backend, key, {"charged": 1})
    for bad in ("", "job:forgettrial:\nx", "x" * 5000):
        with pytest.raises(LockKeyError):
            forget(backend, bad, TASK)
    assert forget(backend, key, "forgettrial.no_such_task") is None
    assert forget(backend, key.replace("job:", "other:", 1), TASK) is None
    assert kept(backend, key) == first.lease.token
    assert forgotten_records(backend, key) == []


# -- a store that fails --------------------------------------------------------------------------


@stores("file", "memory", "postgres", "redis", "gcs", "s3")
def test_a_record_that_cannot_be_written_says_the_success_was_forgotten(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fails after the success is forgotten, as the ``forgotten`` record is
    written: the error must say that the success is gone (and what was forgotten), so
    that the operator neither believes nothing happened nor loses the audit trail."""
    backend, key = case.backend, new_key()
    first = succeed(backend, key, {"charged": 1})

    def down(record: Record) -> None:
        raise BackendError("connection refused", "store://trial")

    monkeypatch.setattr(backend, "add_record", down)
    with pytest.raises(BackendError) as raised:
        forget(backend, key, TASK, reason="refund 9", by="ops@shop")
    monkeypatch.undo()
    assert backend.last_success(key, TASK) is None  # forgotten: what the error must say
    text = str(raised.value)
    assert "was forgotten" in text and "not recorded" in text, text
    assert f"kept by fence {first.fence}" in text and "refund 9" in text
    assert "connection refused" in text
    assert isinstance(raised.value.__cause__, BackendError)


@stores("file", "postgres", "redis", "s3")
def test_a_store_failing_between_the_success_and_its_pages_says_what_is_left(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fails after the first run's success is forgotten, before its pages are:
    the error says which pages may be kept still, and each can then be forgotten by its
    name (left kept, the next run's pages would replay them)."""
    backend, key = case.backend, new_key()
    succeed(backend, key, {"value": None, "replaced": {"nesting": 1, "itself": True}})
    succeed(backend, key, {"value": 1}, task=f"{TASK} (replacement 1)")
    real = backend.forget_success

    def failing_on_pages(key: str, task_name: str, token: str) -> bool:
        if task_name != TASK:
            raise BackendError("connection reset", "store://trial")
        return real(key, task_name, token)

    monkeypatch.setattr(backend, "forget_success", failing_on_pages)
    with pytest.raises(BackendError) as raised:
        forget(backend, key, TASK, reason="resync")
    monkeypatch.undo()
    text = str(raised.value)
    assert "was forgotten" in text and f"{TASK} (replacement 1) may be kept still" in text
    assert backend.last_success(key, TASK) is None
    assert forget(backend, key, f"{TASK} (replacement 1)", reason="the rest") is not None
    assert backend.last_success(key, f"{TASK} (replacement 1)") is None


@stores("file", "memory", "postgres", "redis", "s3")
def test_a_forget_whose_answer_was_lost_is_read_back_and_recorded(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``forget_success`` reaches the store and its answer is lost (a connection cut: the
    Postgres store raises): the success is gone, so the act is recorded, not reported as a
    failure that an operator would run again into "nothing to forget" and no record. A
    call that did not land leaves the success kept and says so."""
    backend, key = case.backend, new_key()
    first = succeed(backend, key, {"charged": 1})
    real = backend.forget_success

    def landed_then_lost(key: str, task_name: str, token: str) -> bool:
        real(key, task_name, token)
        raise BackendError("server closed the connection unexpectedly", "store://trial")

    def lost(key: str, task_name: str, token: str) -> bool:
        raise BackendError("server closed the connection unexpectedly", "store://trial")

    monkeypatch.setattr(backend, "forget_success", lost)
    with pytest.raises(BackendError, match="closed the connection"):
        forget(backend, key, TASK, reason="refund 5")
    assert kept(backend, key) == first.lease.token and forgotten_records(backend, key) == []
    monkeypatch.setattr(backend, "forget_success", landed_then_lost)
    record = forget(backend, key, TASK, reason="refund 5")
    monkeypatch.undo()
    assert record is not None and "found forgotten on reading back" in (record.details or "")
    assert backend.last_success(key, TASK) is None
    assert [r.lease.token for r in forgotten_records(backend, key)] == [record.lease.token]


def test_a_redis_forget_whose_reply_was_lost_is_known_as_ours(
    lossy: CountingProxy, prefix: str
) -> None:
    """The forget script runs, its reply is lost and the client sends it again: the
    second run finds nothing kept. That must not read as "forgotten by another meanwhile"
    (``forget`` then writes no record and the CLI says nothing was touched): the success
    is gone, by this call."""
    backend = open_backend(prefix, via(lossy))
    key = new_key()
    first = succeed(backend, key, {"charged": 1})
    assert backend.forget_success(key, TASK, "not-the-token") is False  # the script loaded
    lossy.drop_next_reply()
    assert backend.forget_success(key, TASK, first.lease.token) is True
    assert lossy.dropped == 1
    assert backend.last_success(key, TASK) is None
    second = succeed(backend, key, {"charged": 2})
    lossy.drop_next_reply()
    record = forget(backend, key, TASK, reason="lost reply")
    assert lossy.dropped == 2
    assert record is not None and f"kept by fence {second.fence}" in (record.details or "")
    assert [r.lease.token for r in forgotten_records(backend, key)] == [record.lease.token]
    backend.close()


@pytest.mark.parametrize("name", ["postgres", "redis", "gcs", "s3"])
def test_forget_on_a_store_that_is_down_is_a_clear_error(name: str) -> None:
    from celery_dlock import backend_from_url
    from tests.backends.conftest import STORES

    with backend_from_url(STORES[name].UNREACHABLE) as backend:
        started = time.monotonic()
        with pytest.raises(BackendError) as raised:
            forget(backend, "job:forgettrial:down", TASK)
        assert time.monotonic() - started < 30
    assert "s3cret" not in str(raised.value)


# -- a once task, duplicates after forget --------------------------------------------------------


@pytest.fixture
def charges(case: StoreCase) -> Iterator[tuple[Any, list[str]]]:
    """A ``once`` charge on the case's store, run eagerly in this process (duplicates wait
    for the key), and the orders it charged."""
    assert case.url is not None
    app = Celery("forget-trial", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, dlock_backend=case.url)
    install(app, janitor=False)
    app.finalize(auto=True)
    charged: list[str] = []

    @app.task(
        shared=False, base=LockedTask, name=TASK, lock_key="forgettrial:{order}", once=True,
        lock_wait=60, lock_ttl=60,
    )  # fmt: skip
    def charge(order: str) -> dict[str, Any]:
        charged.append(order)
        time.sleep(0.3)  # the duplicates are waiting for the key meanwhile
        return {"order": order, "charge": len(charged)}

    assert charge.request_stack is not None  # bound before threads apply it at once
    yield charge, charged


@stores(*BY_URL)
def test_after_forget_concurrent_duplicates_charge_exactly_once_again(
    case: StoreCase, charges: tuple[Any, list[str]]
) -> None:
    charge, charged = charges
    order = uuid.uuid4().hex[:8]
    key = f"job:forgettrial:{order}"
    first = run_together(*[lambda: charge.apply((order,)).get() for _ in range(3)])
    assert charged == [order] and first == [{"order": order, "charge": 1}] * 3
    record = forget(case.backend, key, TASK, reason="refunded")
    assert record is not None
    again = run_together(*[lambda: charge.apply((order,)).get() for _ in range(3)])
    assert charged == [order, order] and again == [{"order": order, "charge": 2}] * 3
    outcomes = [r.outcome for r in reversed(case.backend.history(key=key, limit=None))]
    assert outcomes.count(Outcome.SUCCEEDED) == 2 and outcomes.count(Outcome.FORGOTTEN) == 1
    assert outcomes.index(Outcome.FORGOTTEN) == 3  # after the first three runs' records
