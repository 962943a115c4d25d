from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import celery_dlock
from celery_dlock import (
    ConfigurationError,
    Holder,
    Lease,
    Lock,
    LockKeyError,
    LockLostError,
    LockNotAcquiredError,
    LockTimeoutError,
    Outcome,
    lock,
)
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.records import DETAILS_LIMIT
from tests.support import eventually, force_release


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> MemoryBackend | FileBackend:
    if request.param == "memory":
        return MemoryBackend()
    return FileBackend(str(tmp_path / "locks"))


class CardDeclined(Exception):
    pass


def test_with_block_records_succeeded(backend: MemoryBackend) -> None:
    with lock("job:report", backend) as lease:
        assert backend.get("job:report") == lease
    assert backend.get("job:report") is None
    [record] = backend.history(key="job:report")
    assert record.outcome is Outcome.SUCCEEDED
    assert record.lease.token == lease.token


def test_with_block_records_failed_with_type_message_and_traceback(backend: MemoryBackend) -> None:
    with pytest.raises(CardDeclined), lock("job:pay", backend):
        raise CardDeclined("card 4242 declined " + "x" * 20000)
    [record] = backend.history(key="job:pay")
    assert record.outcome is Outcome.FAILED
    assert record.problem == "tests.test_lock.CardDeclined"
    assert record.details is not None
    assert record.details.startswith("card 4242 declined")
    assert "Traceback" in record.details
    assert len(record.details.encode("utf-8")) <= DETAILS_LIMIT
    assert backend.get("job:pay") is None


def test_busy_key_without_wait_raises_not_acquired_naming_the_holder(
    backend: MemoryBackend,
) -> None:
    holder = Holder.current(task_id="abc", task_name="tasks.charge", worker="w1@h")
    assert backend.try_acquire("job:busy", holder, None) is not None
    with pytest.raises(LockNotAcquiredError) as info:
        Lock(backend, "job:busy").acquire()
    assert not isinstance(info.value, LockTimeoutError)
    assert info.value.key == "job:busy"
    assert info.value.holder is not None and "tasks.charge[abc]" in info.value.holder


def test_busy_key_after_waiting_raises_timeout(backend: MemoryBackend) -> None:
    assert backend.try_acquire("job:slow", Holder.current(), None) is not None
    with pytest.raises(LockTimeoutError) as info:
        Lock(backend, "job:slow", wait=0.2).acquire()
    assert isinstance(info.value, TimeoutError)
    assert info.value.wait == 0.2


def test_waiter_gets_the_key_when_it_is_released(backend: MemoryBackend) -> None:
    first = Lock(backend, "job:queue")
    first.acquire()
    got: list[Lease] = []
    second = Lock(backend, "job:queue", wait=None)  # kept: a dropped Lock lets go of its lease
    waiter = threading.Thread(target=lambda: got.append(second.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # blocked while the key is held
    first.release()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert got and got[0].key == "job:queue"
    held = backend.get("job:queue")
    assert held is not None and held.token == got[0].token
    second.release()


def test_acquire_wait_argument_overrides_the_lock_default(backend: MemoryBackend) -> None:
    assert backend.try_acquire("job:override", Holder.current(), None) is not None
    with pytest.raises(LockTimeoutError):
        Lock(backend, "job:override", wait=None).acquire(wait=0.05)


def test_every_acquisition_gets_a_fresh_holder_nonce(backend: MemoryBackend) -> None:
    the_lock = Lock(backend, "job:nonce")
    first = the_lock.acquire()
    the_lock.release()
    second = the_lock.acquire()
    the_lock.release()
    assert first.holder.nonce != second.holder.nonce


def test_lost_lease_makes_the_with_block_raise_lock_lost(backend: MemoryBackend) -> None:
    with pytest.raises(LockLostError) as info, lock("job:lost", backend) as lease:
        force_release(backend, "job:lost", "operator")
    assert info.value.key == "job:lost" and info.value.fence == lease.fence
    lost, forced = backend.history(key="job:lost")
    assert forced.outcome is Outcome.FORCED and forced.lease.token == lease.token
    # The history stays true: the holder's own end is recorded, as lost, naming its outcome.
    assert lost.outcome is Outcome.LOST and lost.lease.token == lease.token
    assert lost.details is not None and lost.details.startswith("succeeded not recorded")


def test_body_exception_wins_over_a_lost_lease(backend: MemoryBackend) -> None:
    with pytest.raises(CardDeclined), lock("job:lost2", backend):
        force_release(backend, "job:lost2", "operator")
        raise CardDeclined("declined")


def test_renew_of_a_lost_lease_raises(backend: MemoryBackend) -> None:
    the_lock = Lock(backend, "job:renew", ttl=60)
    the_lock.acquire()
    assert the_lock.renew().token == the_lock.lease.token  # type: ignore[union-attr]
    force_release(backend, "job:renew", "operator")
    with pytest.raises(LockLostError):
        the_lock.renew()
    the_lock.release()


def test_background_renewal_keeps_a_short_lease_alive() -> None:
    backend = MemoryBackend()
    # ttl 1.5: renewals every 0.5 s, each with 1.5 s to land (0.3 s was not enough under load).
    the_lock = Lock(backend, "job:long", ttl=1.5)
    first = the_lock.acquire()
    eventually(
        lambda: (
            (current := backend.get("job:long")) is not None
            and current.expires_at is not None
            and first.expires_at is not None
            and current.expires_at > first.expires_at + 2.0  # renewed after the first expiry
        ),
        "several renewals",
    )
    assert time.time() > first.expires_at  # type: ignore[operator]  # past the first expiry
    held = backend.get("job:long")
    assert held is not None and held.token == first.token
    record = the_lock.release()
    assert record is not None and record.outcome is Outcome.SUCCEEDED
    assert not the_lock.lost


def test_background_renewal_reports_a_lost_lease() -> None:
    backend = MemoryBackend()
    lost: list[Lease] = []
    the_lock = Lock(backend, "job:gone", ttl=0.3, on_lost=lost.append)
    lease = the_lock.acquire()
    force_release(backend, "job:gone", "operator")
    # The renewer sets ``lost`` first, then calls on_lost: wait for both.
    eventually(lambda: the_lock.lost and lost, "loss noticed and reported")
    assert [item.token for item in lost] == [lease.token]
    assert the_lock.release() is None


def test_no_renewal_thread_without_ttl(backend: MemoryBackend) -> None:
    before = threading.active_count()
    with lock("job:nothread", backend):
        assert threading.active_count() == before


def test_a_lease_released_before_its_first_renewal_costs_no_thread(
    backend: MemoryBackend,
) -> None:
    """A lease with a ttl starts its renewal thread when the first renewal is due, not at
    the grant: most task runs end sooner (on Redis every lock has a ttl now), and a thread
    started and joined per run cost throughput. One that is held that long is renewed."""

    def renewers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("dlock-renew:")]

    for n in range(20):
        with lock(f"job:short:{n}", backend, ttl=30):
            assert renewers() == []
    with lock("job:long", backend, ttl=0.3) as lease:
        renewed = eventually(
            lambda: (current := backend.get("job:long")) and current.expires_at > lease.expires_at,
            "the lease renewed",
        )
        assert renewers() == ["dlock-renew:job:long"] and renewed


def test_misuse_is_refused(backend: MemoryBackend) -> None:
    the_lock = Lock(backend, "job:misuse")
    with pytest.raises(ConfigurationError, match="not held"):
        the_lock.release()
    the_lock.acquire()
    with pytest.raises(ConfigurationError, match="already held"):
        the_lock.acquire()
    the_lock.release()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl": 0}, "ttl"),
        ({"ttl": -5}, "ttl"),
        ({"ttl": "60"}, "ttl"),
        ({"ttl": float("inf")}, "up to 315360000 \\(ten years\\), or None"),
        ({"ttl": float("nan")}, "ttl"),
        ({"wait": -1}, "wait"),
        ({"wait": float("nan")}, "wait"),
        ({"wait": True}, "wait"),
    ],
)
def test_bad_ttl_or_wait_is_refused(
    backend: MemoryBackend, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Lock(backend, "job:bad", **kwargs)  # type: ignore[arg-type]


def test_bad_key_is_refused(backend: MemoryBackend) -> None:
    with pytest.raises(LockKeyError):
        Lock(backend, "")
    with pytest.raises(LockKeyError):
        Lock(backend, "job:\n")


def test_a_url_backend_is_made_once_per_process(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/shared"
    first, second = Lock(url, "job:a"), Lock(url, "job:b")
    assert first.backend is second.backend
    with first:
        assert second.backend.get("job:a") is not None


def test_attempt_takes_a_free_key_and_answers_none_for_a_busy_one(backend: MemoryBackend) -> None:
    first = Lock(backend, "job:attempt")
    taken = first.attempt()
    assert taken is not None and first.lease == taken
    second = Lock(backend, "job:attempt")
    assert second.attempt() is None and second.lease is None  # busy: no error, nothing held
    current = second.current()
    assert current is not None and current.token == taken.token
    first.release()
    again = second.attempt()
    assert again is not None and again.fence > taken.fence
    with pytest.raises(ConfigurationError, match="already held"):
        second.attempt()
    second.release()


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"])
def test_a_bad_limit_is_refused_by_name(backend: MemoryBackend, limit: Any) -> None:
    with pytest.raises(ConfigurationError, match="limit must be a whole number"):
        Lock(backend, "job:x", limit=limit)


def test_lock_of_several_keys_gives_all_or_none_and_a_limit_gives_a_semaphore(
    backend: MemoryBackend,
) -> None:
    with celery_dlock.lock(["job:acct:2", "job:acct:1"], backend) as leases:
        assert [lease.key for lease in leases] == ["job:acct:1", "job:acct:2"]
    pool = celery_dlock.lock("job:export", backend, limit=2)
    assert isinstance(pool, Lock) and pool.slots == ("job:export#0", "job:export#1")
    with pytest.raises(ConfigurationError, match="at least one key"):
        celery_dlock.lock([], backend)


def test_a_lock_collected_while_held_releases_its_lease_as_abandoned(
    backend: MemoryBackend,
) -> None:
    lock = Lock(backend, "job:dropped")
    held = lock.acquire()
    with pytest.warns(ResourceWarning, match="job:dropped.*garbage-collected"):
        del lock
        gc.collect()
    assert backend.get("job:dropped") is None
    [record] = backend.history(key="job:dropped")
    assert record.outcome is Outcome.ABANDONED and record.lease.token == held.token
    assert record.details == "was garbage-collected while held"


def test_a_released_or_detached_lock_collected_later_changes_nothing(
    backend: MemoryBackend,
) -> None:
    released, kept = Lock(backend, "job:done"), Lock(backend, "job:kept")
    released.acquire()
    released.release()
    lease = kept.acquire()
    assert kept.detach() == lease
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del released, kept
        gc.collect()
    assert [r.outcome for r in backend.history(key="job:done")] == [Outcome.SUCCEEDED]
    current = backend.get("job:kept")
    assert current is not None and current.token == lease.token  # detached: still held
    backend.release(lease, Outcome.SUCCEEDED)


def test_release_all_releases_what_this_process_holds(backend: MemoryBackend) -> None:
    first, second = Lock(backend, "job:all:1"), Lock(backend, "job:all:2")
    first.acquire()
    second.acquire()
    records = celery_dlock.release_all()
    assert sorted(r.key for r in records) == ["job:all:1", "job:all:2"]
    assert {r.outcome for r in records} == {Outcome.ABANDONED}
    assert backend.get("job:all:1") is None and backend.get("job:all:2") is None
    assert first.release() is None  # its lease is gone: recorded lost, not an error


def test_release_all_of_one_backend_leaves_the_others_held(
    backend: MemoryBackend, tmp_path: Path
) -> None:
    other = FileBackend(str(tmp_path / "other"))
    mine, theirs = Lock(backend, "job:one:1"), Lock(other, "job:one:2")
    mine.acquire()
    held_there = theirs.acquire()
    records = celery_dlock.release_all(backend=backend)
    assert [r.key for r in records] == ["job:one:1"] and backend.get("job:one:1") is None
    current = other.get("job:one:2")
    assert current is not None and current.token == held_there.token
    assert [r.key for r in celery_dlock.release_all()] == ["job:one:2"]
    assert other.get("job:one:2") is None


def test_a_process_that_ends_normally_releases_what_it_holds(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'locks'}"
    code = (
        "import celery_dlock\n"
        f"lock = celery_dlock.Lock({url!r}, 'job:exit')\n"
        "lock.acquire()\n"
        "KEEP = lock  # referenced to the end: released by the exit handler\n"
    )
    ended = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ended.returncode == 0, ended.stderr
    assert "ResourceWarning" in ended.stderr and "job:exit" in ended.stderr
    with celery_dlock.backend_from_url(url) as store:
        assert store.get("job:exit") is None
        [record] = store.history(key="job:exit")
        assert record.outcome is Outcome.ABANDONED
        assert record.details == "was still held when the process ended"


# -- metadata ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        (["a"], "must be a dict, not list"),
        ({1: "a"}, "keys must be strings"),
        ({"a": object()}, "must be JSON"),
        ({"a": float("nan")}, "must be JSON"),
        ({"a": "x" * 4096}, "past the limit of 4096"),
    ],
)
def test_bad_metadata_is_refused_with_the_problem_named(metadata: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Lock(MemoryBackend(), "job:meta", metadata=metadata)


def test_metadata_up_to_the_limit_is_kept_as_a_copy() -> None:
    backend = MemoryBackend()
    metadata = {"a": "x" * (4096 - len('{"a":""}'))}  # exactly 4096 bytes of JSON
    lock = Lock(backend, "job:meta", metadata=metadata)
    metadata["a"] = "changed"  # later changes by the caller do not reach the lease
    with lock as lease:
        assert lease.metadata is not None and len(lease.metadata["a"]) == 4088
    [record] = backend.history(key="job:meta")
    assert record.lease.metadata == lease.metadata


def test_locks_and_lock_pass_metadata_to_every_key() -> None:
    backend = MemoryBackend()
    with celery_dlock.lock(["job:a", "job:b"], backend, metadata={"transfer": 7}) as leases:
        assert [lease.metadata for lease in leases] == [{"transfer": 7}] * 2
    records = backend.history()
    assert sorted(r.key for r in records) == ["job:a", "job:b"]
    assert all(r.lease.metadata == {"transfer": 7} for r in records)


def test_a_lock_without_a_store_names_the_problem() -> None:
    """``lock(..., backend=os.environ.get("LOCKS"))`` with the variable unset: not an
    AttributeError about ``default_ttl`` from inside the Lock."""
    with pytest.raises(ConfigurationError, match="store URL or a LockBackend, not None"):
        Lock(None, "job:x")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not None"), lock("job:x", backend=None):  # type: ignore[arg-type]
        pass


def test_abandoning_a_lease_that_had_ended_says_so_and_records_nothing() -> None:
    """At the process's end a lease still in the registry whose store had ended it already
    (expired and taken over, forced): the warning said "released as abandoned" though no
    release happened."""
    from celery_dlock.process import abandon

    store = MemoryBackend()
    held = Lock(store, "job:gone", ttl=60, renew=False)
    lease = held.acquire()
    force_release(store, "job:gone", "operator")
    with pytest.warns(ResourceWarning, match="it had ended already"):
        assert abandon(lease.token, "was still held when the process ended") is None
    assert [r.outcome for r in store.history(key="job:gone")] == [Outcome.FORCED]
    other = Lock(store, "job:kept", ttl=60, renew=False)
    kept = other.acquire()
    with pytest.warns(ResourceWarning, match="released as abandoned"):
        assert abandon(kept.token, "was still held when the process ended") is not None
    assert [r.outcome for r in store.history(key="job:kept")] == [Outcome.ABANDONED]
