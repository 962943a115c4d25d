"""Keys, task options and settings: refused with an error that names the problem
when the task is defined or the app configured; the default store."""

from __future__ import annotations

import logging
import sys
import traceback
import uuid
from typing import Any

import pytest
from celery import Celery

from celery_dlock import (
    ConfigurationError,
    LockedTask,
    LockKeyError,
    UnknownBackendError,
)
from celery_dlock.celery.settings import backend_for, settings


@pytest.fixture
def lazy_app() -> Celery:
    """An app of this test's own: a task whose definition fails stays pending in its app,
    and would fail again when a shared app is finalized by a later test."""
    return Celery(f"cfg-{uuid.uuid4().hex[:6]}", set_as_current=False)


def test_bad_placeholder_names_task_and_placeholder(lazy_app: Celery) -> None:
    with pytest.raises(LockKeyError) as info:

        @lazy_app.task(base=LockedTask, name="shop.charge", lock_key="order:{order}", shared=False)
        def charge(order_id: int) -> None:
            pass

        charge.name  # noqa: B018 - creates the task on a lazy app
    assert "shop.charge" in str(info.value) and "'order'" in str(info.value)


def test_bound_task_signature_skips_self(lazy_app: Celery) -> None:
    @lazy_app.task(
        base=LockedTask, bind=True, name="shop.bound", lock_key="o:<order_id>", shared=False
    )
    def bound(self: Any, order_id: int) -> None:
        pass

    assert bound.lock_key_for((7,)) == "job:o:7"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_key": "o:{order_id}", "on_locked": "wait"}, "on_locked must be one of"),
        ({"lock_key": "o:{order_id}", "lock_ttl": 0}, "ttl"),
        ({"lock_key": "o:{order_id}", "lock_wait": -1}, "lock_wait"),
        ({"lock_key": "o:{order_id}", "on_lock_lost": "panic"}, "on_lock_lost"),
        ({"lock_key": "o:{order_id}", "lock_limit": 0}, "limit must be a whole number"),
        ({"lock_key": "o:{order_id}", "lock_limit": 2, "once": True}, "once needs lock_limit=1"),
        ({"lock_key": "o:{order_id}", "dedupe": "until_done"}, "dedupe must be None"),
        ({"lock_key": "o:{order_id}", "dedupe": "until_started", "on_duplicate": "drop"}, "on_dup"),
        ({"lock_key": "o:{order_id}", "dedupe": "until_started", "dedupe_ttl": -1}, "ttl"),
        ({"lock_key": ["a:{order_id}", "b:{order_id}"], "once": True}, "all or none"),
        ({"lock_key": ["a:{order_id}", "b:{order_id}"], "lock_limit": 2}, "all or none"),
        ({"lock_key": "o:{order_id}", "lock_metadata": {"a": 1}}, "lock_metadata must be a"),
        ({}, "no lock_key"),
        # found by trying the API: these failed only at the first run, or were taken as true
        ({"lock_key": ""}, "not empty"),
        ({"lock_key": []}, "not empty"),
        ({"lock_key": ["a:{order_id}", " "]}, "not empty"),
        ({"lock_key": "o:{order_id}", "once": "yes"}, "once must be True or False"),
        ({"lock_key": "o:{order_id}", "lock_across_retries": "no"}, "lock_across_retries"),
        ({"lock_key": "o:{order_id}", "lock_retry_max": -1}, "lock_retry_max"),
        ({"lock_key": "o:{order_id}", "lock_retry_max": "3"}, "lock_retry_max"),
    ],
)
def test_bad_options_fail_at_definition(
    lazy_app: Celery, options: dict[str, Any], message: str
) -> None:
    name = f"shop.bad_{uuid.uuid4().hex[:6]}"
    with pytest.raises(ConfigurationError, match=message) as info:

        @lazy_app.task(base=LockedTask, name=name, shared=False, **options)
        def bad(order_id: int) -> None:
            pass

        bad.name  # noqa: B018
    assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("dlock_backend", 42, "dlock_backend must be a URL"),
        ("dlock_namespace", 7, "dlock_namespace"),
        # found by trying: the worker started, and every task failed with a LockKeyError
        ("dlock_namespace", "bad ns\n", "dlock_namespace 'bad ns\\\\n': .*control"),
        ("dlock_ttl", -1, "dlock_ttl"),
        ("dlock_janitor_interval", 0, "dlock_janitor_interval"),
        ("dlock_history_retention", "forever", "dlock_history_retention"),
        ("dlock_on_backend_error", "ignore", "dlock_on_backend_error"),
    ],
)
def test_bad_settings_are_named(name: str, value: Any, message: str) -> None:
    app = Celery("settings", set_as_current=False)
    app.conf[name] = value
    with pytest.raises(ConfigurationError, match=message):
        settings(app)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came in Python 3.11")
def test_a_store_url_of_an_unknown_scheme_is_refused_naming_the_setting_and_its_url() -> None:
    app = Celery("settings", set_as_current=False)
    app.conf.dlock_backend = "postgress://app:s3cret@db/app"
    with pytest.raises(UnknownBackendError) as info:  # its own class, as before
        backend_for(app)
    shown = "".join(traceback.format_exception(info.value))  # what a stopped worker prints
    assert "no lock backend for URL scheme 'postgress'; did you mean 'postgres'?" in shown
    assert "dlock_backend = postgress://app:***@db/app" in shown
    assert "s3cret" not in shown


def test_default_store_is_a_local_file_store_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from celery_dlock.celery import settings as settings_module

    settings_module._warned_default.clear()
    app = Celery("defaults", set_as_current=False)
    with caplog.at_level(logging.WARNING, logger="celery_dlock"):
        current = settings(app)
        assert caplog.messages == []  # reading the settings is pure
        settings_module.warn_if_default_store(current)
        settings_module.warn_if_default_store(settings(app))
    assert current.backend.startswith("file://") and current.default_backend
    assert current.namespace == "job" and current.ttl is None
    assert current.on_backend_error == "retry"
    assert sum("dlock_backend is not set" in m for m in caplog.messages) == 1
