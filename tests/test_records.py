from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from celery_dlock.records import (
    DETAILS_LIMIT,
    Holder,
    Lease,
    Outcome,
    Record,
    describe_exception,
    truncate_utf8,
)


class PaymentDeclined(Exception):
    pass


def test_describe_exception_names_the_type_and_keeps_message_and_traceback() -> None:
    try:
        raise PaymentDeclined("card 4242 declined")
    except PaymentDeclined as exc:
        problem, details = describe_exception(exc)
    assert problem == "tests.test_records.PaymentDeclined"
    assert details.startswith("card 4242 declined\n")
    assert "Traceback (most recent call last)" in details
    assert "raise PaymentDeclined" in details


def test_builtin_exception_type_has_no_module_prefix() -> None:
    assert describe_exception(ValueError("x"))[0] == "ValueError"


def test_details_are_bounded_to_8_kib_keeping_head_and_tail() -> None:
    message = "HEAD " + "é" * 20000 + " TAIL"
    _, details = describe_exception(RuntimeError(message))
    assert len(details.encode("utf-8")) <= DETAILS_LIMIT
    assert details.startswith("HEAD ")
    assert details.rstrip().endswith("TAIL")
    assert "[... truncated ...]" in details


@pytest.mark.parametrize("size", [0, 1, 100, DETAILS_LIMIT - 1, DETAILS_LIMIT])
def test_short_text_is_not_truncated(size: int) -> None:
    assert truncate_utf8("a" * size) == "a" * size


def test_truncation_never_splits_a_character() -> None:
    text = "😀" * 5000
    cut = truncate_utf8(text, 1001)
    assert len(cut.encode("utf-8")) <= 1001
    cut.encode("utf-8")  # would raise on a lone surrogate


def test_holder_of_this_process_is_alive() -> None:
    me = Holder.current(task_id="t1", task_name="tasks.x", worker="w1@host")
    assert me.pid == os.getpid()
    assert me.started is not None and me.host_id
    assert not me.is_gone()
    assert "tasks.x[t1] on w1@host" in me.describe()


def test_nonce_is_new_for_every_holder() -> None:
    assert Holder.current().nonce != Holder.current().nonce


def test_holder_of_a_finished_process_is_gone() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json,celery_dlock.records as r;print(json.dumps(r.Holder.current().to_dict()))",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = child.communicate()
    holder = Holder.from_dict(json.loads(out))
    assert holder.pid == child.pid
    assert holder.is_gone()


def test_recycled_pid_is_gone_and_other_hosts_are_never_judged() -> None:
    me = Holder.current()
    assert me.started is not None
    recycled = dataclasses.replace(me, started=me.started - 1.0)
    assert recycled.is_gone()
    elsewhere = dataclasses.replace(me, host_id="other-boot/pid:[1]", started=0.0)
    assert not elsewhere.is_gone()
    unknown = dataclasses.replace(me, host_id="")
    assert not unknown.is_gone()


def test_lease_and_record_round_trip_through_dicts() -> None:
    lease = Lease("job:k", "t" * 32, 7, Holder.current(task_name="tasks.x"), 1.5, 9.25)
    assert Lease.from_dict(lease.to_dict()) == lease
    record = Record(lease, 2.5, Outcome.FAILED, "ValueError", "bad", {"a": [1, None]})
    assert Record.from_dict(record.to_dict()) == record
    assert str(Outcome.DISCONNECTED) == "disconnected"


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"worker": None, "task_id": None, "task_name": None},
        {"worker": 'w\u00f6rker "one"\n\\', "task_name": "\ud800 lone surrogate"},
        {"host": "h\u00f4te", "started": None, "host_id": "portable:boot-1"},
        {"started": 1234.5678901234567, "pid": 2**22},
        {"metadata": {"tenant": "acme", "n": [1, 2.5, None], "\u00e9": {"x": True}}},
    ],
    ids=["task", "no task", "escapes", "portable", "floats", "metadata"],
)
@pytest.mark.parametrize("ensure_ascii", [True, False], ids=["ascii", "utf-8"])
def test_holder_and_lease_json_is_the_text_json_dumps_gives(
    change: dict[str, object], ensure_ascii: bool
) -> None:
    base = Holder.current(worker="w1@host", task_id="4f7c6a2e-1", task_name="payments.charge")
    holder = dataclasses.replace(base, **change)  # type: ignore[arg-type]
    compact = {"separators": (",", ":"), "ensure_ascii": ensure_ascii}
    assert holder.to_json(ensure_ascii) == json.dumps(holder.to_dict(), **compact)
    assert Holder.from_dict(json.loads(holder.to_json(ensure_ascii))) == holder
    for lease in (
        Lease('job:\u00e9t\u00e9 "q"', "t" * 32, 2**53 + 1, holder, 1795283662.263032, None),
        Lease("job:k", "t" * 32, 7, holder, 1.5, 1795283662.263032 + 30),
    ):
        assert lease.to_json(ensure_ascii) == json.dumps(lease.to_dict(), **compact)
        assert Lease.from_dict(json.loads(lease.to_json(ensure_ascii))) == lease


def test_a_zombie_holder_is_gone() -> None:
    # A child that exited but is not yet collected by its parent (us) is a zombie.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json,celery_dlock.records as r;"
            "print(json.dumps(r.Holder.current().to_dict()), flush=True)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    holder = Holder.from_dict(json.loads(child.stdout.readline()))
    deadline = time.monotonic() + 10
    while True:  # wait for the exit without collecting the child
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        assert time.monotonic() < deadline
    assert holder.is_gone()
    child.wait()
    child.stdout.close()


def test_a_leases_repr_and_a_records_keep_its_token_out_of_logs() -> None:
    """The token is the lease's release capability: ``print(lease)`` or a log line with the
    lease or its record must not carry it; ``to_dict`` (the store's own) still does."""
    lease = Lease("job:order:42", "b6b439cd2e7c3789", 17, Holder.current(), time.time())
    record = Record(lease, time.time(), Outcome.SUCCEEDED, None, None)
    for text in (repr(lease), str(lease), repr(record)):
        assert "b6b439cd2e7c3789" not in text and "job:order:42" in text and "17" in text
    assert lease.to_dict()["token"] == "b6b439cd2e7c3789"


@pytest.mark.parametrize("ttl", [0, -1.0, float("nan")])
def test_a_bad_ttl_says_what_none_means(ttl: float) -> None:
    from celery_dlock import ConfigurationError, Lock
    from celery_dlock.backends.memory import MemoryBackend

    with pytest.raises(ConfigurationError) as raised:
        Lock(MemoryBackend(), "job:ttl", ttl=ttl)
    message = str(raised.value)
    assert "None for the store's default" in message and "no expiry" in message
    assert "None for no expiry," not in message


def test_a_named_holder_without_a_worker_is_shown_by_its_name() -> None:
    """``celery-dlock run``'s leases were shown as a bare ``pid N on host``, like any process."""
    runner = Holder.current(task_name="celery-dlock run")
    assert runner.describe() == f"celery-dlock run (pid {os.getpid()} on {runner.host})"
    assert Holder.current().describe() == f"pid {os.getpid()} on {runner.host}"
