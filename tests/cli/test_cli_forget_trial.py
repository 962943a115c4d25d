"""An adversarial trial of ``celery-dlock forget``, as a payments operator scripts it and
answers it: what it shows is what it forgets (the kept success changing while the question
is asked), ``--json`` and exit codes for every ending, odd keys, a store that is down."""

from __future__ import annotations

import json

from celery_dlock import Holder
from tests.cli.clitools import CliStore, popen_cli, run_cli
from tests.cli.test_cli_commands import _read_until
from tests.test_forget_trial import TASK, kept, new_key, succeed
from tests.test_forget_trial import forgotten_records as forgotten


def page(n: int) -> str:
    return f"{TASK} (replacement {n})"


def test_a_success_replaced_while_the_question_is_asked_is_left_alone(store: CliStore) -> None:
    """Shown the first charge's success; before the operator answers, a colleague forgets
    it and a new charge keeps its own. The "y" must not forget the new one."""
    key = new_key()
    shown = succeed(store.backend, key, {"charged": 1})
    with popen_cli("--backend", store.url, "forget", key, "--task", TASK, "--json") as process:
        assert process.stderr is not None
        seen = _read_until(process.stderr, b"[y/N]")
        assert shown.lease.holder.task_id is not None
        assert shown.lease.holder.task_id.encode() in seen
        assert store.backend.forget_success(key, TASK, shown.lease.token)
        newer = succeed(store.backend, key, {"charged": 2})
        out, _ = process.communicate(b"y\n", timeout=60)
    assert process.returncode == 1
    data = json.loads(out)
    assert (data["status"], data["forgotten"], data["record"]) == ("changed", False, None)
    assert data["kept"]["lease"]["token"] == shown.lease.token
    assert kept(store.backend, key) == newer.lease.token
    assert forgotten(store.backend, key) == []


def test_what_the_command_says_it_forgot_is_what_it_forgot(file_store: CliStore) -> None:
    """A sync's first page is shown as kept; before the answer, its second page keeps its
    success too. What the command says it forgot must be what it forgot."""
    backend, key = file_store.backend, new_key()
    succeed(backend, key, {"value": None, "replaced": {"nesting": 1, "itself": True}})
    succeed(backend, key, {"value": 1}, task=page(1))
    with popen_cli("--backend", file_store.url, "forget", key, "--task", TASK) as process:
        assert process.stdout is not None
        seen = _read_until(process.stdout, b"[y/N]")
        assert f"replacements: {page(1)}\n".encode() in seen
        second = succeed(backend, key, {"value": 2}, task=page(2))
        out, err = process.communicate(b"y\n", timeout=60)
    assert process.returncode == 0, err
    [record] = forgotten(backend, key)
    said = out.decode()
    # The page kept since the question belongs to the run forgotten: left kept, the next
    # run's second page would replay it. So it goes too, and the command says so.
    assert kept(backend, key, page(1)) is None and kept(backend, key, page(2)) is None
    assert second.lease.token not in said
    assert f"and those of {page(1)}, {page(2)} forgotten" in said, said
    assert record.details is not None and record.details in said


def test_json_and_exit_codes_for_every_ending(store: CliStore) -> None:
    key = new_key()
    base = ("--backend", store.url, "forget", key, "--task", TASK, "--json")
    none = run_cli(*base, "--force")
    assert none.returncode == 1
    data = json.loads(none.stdout)
    assert (data["status"], data["kept"], data["record"]) == ("not_kept", None, None)

    first = succeed(store.backend, key, {"charged": 1})
    declined = run_cli(*base, input="n\n")
    assert declined.returncode == 1 and json.loads(declined.stdout)["status"] == "declined"
    assert kept(store.backend, key) == first.lease.token

    done = run_cli(*base, "--force", "--reason", "refund #77 ✓")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["status"], data["forgotten"]) == ("forgotten", True)
    assert data["kept"]["lease"]["token"] == first.lease.token
    assert data["record"]["outcome"] == "forgotten"
    assert data["record"]["details"].endswith("with celery-dlock forget: refund #77 ✓")
    [record] = forgotten(store.backend, key)
    assert record.lease.token == data["record"]["lease"]["token"]

    again = run_cli(*base, "--force")
    assert again.returncode == 1 and json.loads(again.stdout)["status"] == "not_kept"
    assert len(forgotten(store.backend, key)) == 1


def test_odd_keys_and_a_bad_key(file_store: CliStore) -> None:
    odd = "job:forgettrial:ü ñ 'x' \"y\" %2F #*"
    first = succeed(file_store.backend, odd, {"charged": 1})
    done = run_cli("--backend", file_store.url, "forget", odd, "--task", TASK, "--force")
    assert done.returncode == 0, done.stderr
    assert file_store.backend.last_success(odd, TASK) is None
    assert f"fence {first.fence}" in done.stdout
    for bad in ("", "job:forgettrial:a\x07b"):
        refused = run_cli("--backend", file_store.url, "forget", bad, "--task", TASK, "--force")
        assert refused.returncode == 2, refused
        assert "key" in refused.stderr and "Traceback" not in refused.stderr


def test_a_store_that_is_down_is_a_clear_error_and_changes_nothing() -> None:
    url = "redis://:s3cret@127.0.0.1:1/0?retries=0"
    result = run_cli("--backend", url, "forget", new_key(), "--task", TASK, "--force", "--json")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "s3cret" not in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip()


def test_a_run_going_on_and_a_queued_message_are_told_before_the_question(
    store: CliStore,
) -> None:
    """A run holds the key (a duplicate that started before the success was kept, its
    lease outliving the first's) and a message is queued under a dedupe mark: forgetting
    does not stop either, and the operator who forgets so that the next run charges anew
    is told that the next runs are already on their way."""
    key = new_key()
    first = succeed(store.backend, key, {"charged": 1})
    running = Holder.current(task_name=TASK, task_id="t-running", worker="celery@w1")
    assert store.backend.try_acquire(key, running, 60.0) is not None
    queued = Holder.current(task_name=TASK, task_id="t-queued")
    assert store.backend.try_acquire(f"{key}#queued:{TASK}", queued, 60.0) is not None
    result = run_cli("--backend", store.url, "forget", key, "--task", TASK, input="n\n")
    assert result.returncode == 1
    assert f"note: a run holds {key} now" in result.stdout and "t-running" in result.stdout
    assert f"note: a message of {TASK} is queued for {key}" in result.stdout
    assert "t-queued" in result.stdout
    assert kept(store.backend, key) == first.lease.token
    done = run_cli("--backend", store.url, "forget", key, "--task", TASK, "--force", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["status"] == "forgotten"
    assert "note: a run holds" in done.stderr
