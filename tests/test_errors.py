from __future__ import annotations

import json
import pickle

import pytest

from celery_dlock import (
    AlreadySucceededError,
    BackendError,
    ConfigurationError,
    DLockError,
    DuplicateTaskError,
    LockKeyError,
    LockLostError,
    LockNotAcquiredError,
    LockTimeoutError,
    MissingDependencyError,
    UnknownBackendError,
)
from tests.support import unavailable

EXAMPLES: list[DLockError] = [
    DLockError("something"),
    LockNotAcquiredError("job:order:42", "tasks.charge[abc] (pid 7 on web-1)"),
    LockNotAcquiredError("job:order:42"),
    LockTimeoutError("job:order:42", 5.0, "pid 7 on web-1"),
    LockLostError("job:order:42", 17, "renew"),
    AlreadySucceededError("job:order:42", "payments.charge", 17, "5f1c"),
    DuplicateTaskError("job:customer:7#queued:sync", "5f1c"),
    DuplicateTaskError("job:customer:7#queued:sync"),
    BackendError("cannot reach the store", "redis://:***@cache:6379/0"),
    ConfigurationError("bad option"),
    LockKeyError("the lock key is empty"),
    UnknownBackendError("postgress", "postgres"),
    MissingDependencyError("postgresql", "psycopg", "postgres"),
]


def _same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b)
    assert a.args == b.args
    assert str(a) == str(b)
    assert vars(a) == vars(b)


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_error_survives_pickle_and_rebuild_from_args(error: DLockError) -> None:
    _same(pickle.loads(pickle.dumps(error)), error)
    _same(type(error)(*error.args), error)


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_error_args_are_plain_json(error: DLockError) -> None:
    assert json.loads(json.dumps(error.args)) == list(error.args)


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_error_survives_celerys_json_result_round_trip(error: DLockError) -> None:
    try:
        from celery import Celery
    except ImportError:
        unavailable("celery is not installed: pip install 'celery-dlock[celery]'")
    app = Celery("errors", backend="cache+memory://", set_as_current=False)
    app.conf.result_serializer = "json"
    stored = json.loads(json.dumps(app.backend.prepare_exception(error, "json")))
    _same(app.backend.exception_to_python(stored), error)


def test_messages_name_what_went_wrong() -> None:
    assert (
        str(LockNotAcquiredError("job:k", "pid 7 on web-1"))
        == "lock 'job:k' is held by pid 7 on web-1"
    )
    assert "after waiting 2.5 s" in str(LockTimeoutError("job:k", 2.5))
    assert "did you mean 'postgres'?" in str(UnknownBackendError("postgress", "postgres"))
    assert "pip install 'celery-dlock[postgres]'" in str(
        MissingDependencyError("postgresql", "psycopg", "postgres")
    )
    assert str(DuplicateTaskError("job:k#queued:t", "5f1c")) == (
        "not sent: 'job:k#queued:t' is queued already as task 5f1c"
    )
    assert str(LockLostError("job:k", 3, "release")) == (
        "lease on 'job:k' with fence 3 was lost (seen on release)"
    )


def test_error_tree() -> None:
    assert issubclass(LockTimeoutError, LockNotAcquiredError)
    assert issubclass(LockTimeoutError, TimeoutError)
    for cls in (LockKeyError, UnknownBackendError, MissingDependencyError):
        assert issubclass(cls, ConfigurationError)
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(MissingDependencyError, ImportError)
    for cls in (
        LockNotAcquiredError,
        LockLostError,
        DuplicateTaskError,
        BackendError,
        ConfigurationError,
    ):
        assert issubclass(cls, DLockError)
