"""A misspelt ``LockedTask`` option or ``dlock_*`` setting is refused, naming it and the
closest known one: Celery makes every ``@app.task`` keyword a class attribute and keeps every
conf key, so ``lock_tll=5`` or ``app.conf.dlock_ttll = 5`` ran with no ttl, silently.
Celery's own options and the user's own attributes and settings still pass."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dlock import ConfigurationError, LockedTask
from celery_dlock.celery import settings as settings_module
from celery_dlock.celery.settings import forget_settings, settings


def lazy_app() -> Celery:
    """An app of the test's own: a task whose definition fails stays pending in its app."""
    return Celery(f"typo-{uuid.uuid4().hex[:6]}", set_as_current=False)


def define(app: Celery, base: type = LockedTask, **options: Any) -> Any:
    name = f"shop.charge_{uuid.uuid4().hex[:6]}"

    @app.task(base=base, name=name, lock_key="order:{order_id}", shared=False, **options)
    def charge(order_id: int) -> int:
        return order_id

    charge.name  # noqa: B018 - creates the task on a lazy app
    return charge


# -- task options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("lock_tll", "lock_ttl"),
        ("lock_limt", "lock_limit"),
        ("lock_keys", "lock_key"),
        ("on_lock_los", "on_lock_lost"),
        ("on_duplicates", "on_duplicate"),
        ("dedupe_tll", "dedupe_ttl"),
        ("dedup", "dedupe"),
        ("once_", "once"),
        ("dlock_ttl", "lock_ttl"),  # the setting's name given to a task
    ],
)
def test_a_misspelt_task_option_is_refused_naming_the_task_and_the_option(
    typo: str, meant: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        define(lazy_app(), **{typo: 5})
    text = str(info.value)
    assert text.startswith("task shop.charge_")
    assert f"unknown option {typo} (did you mean {meant}?)" in text


def test_an_unknown_option_with_no_close_one_lists_the_options() -> None:
    with pytest.raises(ConfigurationError, match="unknown option dlock_xyzzy") as info:
        define(lazy_app(), dlock_xyzzy=1)
    assert "lock_ttl" in str(info.value) and "on_lock_lost" in str(info.value)


def test_a_misspelt_option_of_a_task_class_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown option lock_tll \(did you mean"):

        class Charge(LockedTask):  # type: ignore[misc]
            name = f"shop.class_{uuid.uuid4().hex[:6]}"
            lock_key = "order:{order_id}"
            lock_tll = 5

            def run(self, order_id: int) -> None:
                pass


def test_celerys_own_options_and_the_users_own_attributes_pass() -> None:
    task = define(
        lazy_app(),
        bind=False,
        rate_limit="10/s",
        acks_late=True,
        autoretry_for=(ValueError,),
        max_retries=3,
        ignore_result=True,
        serializer="json",
        typing=True,
        tenant_field="tenant",  # the user's own, not in our names
        locker="a",  # starts like ours but not with one of our prefixes
        **{name: getattr(LockedTask, name) for name in ("lock_ttl", "once", "lock_limit")},
    )
    assert task.tenant_field == "tenant" and task.rate_limit == "10/s"


def test_an_attribute_of_the_users_own_base_may_be_set_by_its_tasks() -> None:
    """A user's abstract base that adds an attribute of its own in our names: its tasks
    override it; only a name that no base class defines is refused."""

    class TenantTask(LockedTask):  # type: ignore[misc]
        abstract = True
        lock_tenant_field = "tenant_id"

    task = define(lazy_app(), base=TenantTask, lock_tenant_field="account_id")
    assert task.lock_tenant_field == "account_id"
    # and LockedTask's own methods overridden in a task class are not options misspelt
    assert define(lazy_app(), lock_key_for=LockedTask.lock_key_for).lock_key_for


def test_a_misspelt_option_of_the_users_own_abstract_base_is_refused() -> None:
    """Its tasks would all run with no ttl: the typo sits on a base, which defines it, so
    the task's own check took it for the base's attribute."""
    with pytest.raises(ConfigurationError) as info:

        class TenantTask(LockedTask):  # type: ignore[misc]
            abstract = True
            lock_tll = 5

    assert str(info.value) == "class TenantTask: unknown option lock_tll (did you mean lock_ttl?)"

    class FineTask(LockedTask):  # type: ignore[misc]  # far from every option: its own
        abstract = True
        lock_tenant_field = "tenant_id"
        lock_ttl = 5

    assert define(lazy_app(), base=FineTask).lock_ttl == 5


# -- settings -------------------------------------------------------------------------------


def test_a_misspelt_setting_is_refused_naming_the_closest() -> None:
    app = Celery("typo-settings", set_as_current=False)
    app.conf.dlock_backend = "memory://"
    # Configured first: Celery before 5.7 keeps a key set before that in its defaults too,
    # where the ``del`` below does not reach.
    assert app.conf.dlock_backend == "memory://"
    app.conf.dlock_ttll = 5
    with pytest.raises(ConfigurationError) as info:
        settings(app)
    assert str(info.value) == "unknown setting dlock_ttll (did you mean dlock_ttl?)"
    del app.conf["dlock_ttll"]
    app.conf.dlock_ttl = 5
    assert settings(app).ttl == 5.0


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"dlock_namepsace": "x"}, "setting dlock_namepsace (did you mean dlock_namespace?)"),
        ({"dlock_backends": "memory://"}, "setting dlock_backends (did you mean dlock_backend?)"),
        ({"dlock_TTL": 5}, "unknown setting dlock_TTL (did you mean dlock_ttl?)"),
        ({"dlock_retention": 60}, "(did you mean dlock_history_retention?)"),
        ({"dlock_frobnicate": 1}, "the settings are dlock_backend, dlock_namespace"),
    ],
)  # fmt: skip
def test_a_misspelt_setting_from_an_object_is_refused(given: dict[str, Any], message: str) -> None:
    config = types.SimpleNamespace(broker_url="memory://", dlock_backend="memory://", **given)
    app = Celery("typo-object", set_as_current=False)
    app.config_from_object(config)
    with pytest.raises(ConfigurationError) as info:
        settings(app)
    assert message in str(info.value)


def test_a_misspelt_setting_under_a_namespace_is_named_as_given(tmp_path: Path) -> None:
    """Django's way: ``config_from_object("django.conf:settings", namespace="CELERY")``."""
    config = types.SimpleNamespace(
        CELERY_BROKER_URL="memory://",
        CELERY_DLOCK_BACKEND="memory://",
        CELERY_DLOCK_TTLL=5,
        DLOCK_UNRELATED="a Django setting of the project's own",
    )
    app = Celery("typo-namespace", set_as_current=False)
    app.config_from_object(config, namespace="CELERY")
    with pytest.raises(ConfigurationError) as info:
        settings(app)
    assert str(info.value) == "unknown setting CELERY_DLOCK_TTLL (did you mean CELERY_DLOCK_TTL?)"
    del config.CELERY_DLOCK_TTLL
    fixed = Celery("typo-namespace-fixed", set_as_current=False)
    fixed.config_from_object(config, namespace="CELERY")
    assert settings(fixed).backend == "memory://"  # read through the namespace


def test_settings_in_upper_case_are_read_from_an_old_style_config() -> None:
    """As Celery reads ``BROKER_URL``: ``DLOCK_BACKEND`` was ignored, so the tasks took
    their locks in the local default store, which other hosts do not share."""
    config = types.SimpleNamespace(
        BROKER_URL="memory://", DLOCK_BACKEND="memory://", DLOCK_TTL=5, DLOCK_LEGACY=1
    )
    app = Celery("upper-case", set_as_current=False)
    app.config_from_object(config)
    current = settings(app)
    assert (current.backend, current.default_backend, current.ttl) == ("memory://", False, 5.0)
    assert current.namespace == "job"  # not given either way: the default


def test_a_setting_spelt_both_ways_with_two_values_is_refused() -> None:
    app = Celery("both-ways", set_as_current=False)
    app.conf.update(dlock_backend="memory://", DLOCK_BACKEND="memory://", dlock_ttl=5)
    assert settings(app).ttl == 5.0  # the same value both ways is fine
    app.conf.update(DLOCK_TTL=7)
    forget_settings(app)
    with pytest.raises(ConfigurationError) as info:
        settings(app)
    assert str(info.value) == "dlock_ttl is set to 5 and DLOCK_TTL to 7: keep one"


def test_every_setting_and_other_keys_pass() -> None:
    values = {
        "dlock_backend": "memory://",
        "dlock_namespace": "billing",
        "dlock_ttl": 30,
        "dlock_janitor_interval": 10,
        "dlock_history_retention": None,
        "dlock_on_backend_error": "run",
        "dlock_dedupe_ttl": 60,
        "dlock_janitor_marks": 20,
        "dlock_metrics": False,
    }
    assert set(values) == set(settings_module.SETTINGS)
    app = Celery("typo-fine", set_as_current=False)
    app.conf.update(values, DLOCK_LEGACY=1, dlockish=2, my_dlock_thing=3, worker_concurrency=2)
    current = settings(app)
    assert (current.namespace, current.ttl, current.on_backend_error) == ("billing", 30.0, "run")
    assert current.janitor_marks == 20


APP = """
from celery import Celery
from celery_dlock import install

app = Celery("typoapp", broker="memory://", set_as_current=False)
app.conf.dlock_backend = "file://{store}"
app.conf.dlock_ttll = 5
install(app)
"""


def test_a_worker_with_a_misspelt_setting_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "typoapp.py").write_text(textwrap.dedent(APP.format(store=tmp_path / "locks")))
    args = [sys.executable, "-m", "celery", "-A", "typoapp", "worker", "--pool=solo",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    try:
        done = subprocess.run(args, cwd=tmp_path, capture_output=True, timeout=60, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the worker started and ran for 60 s: {exc.stderr!r}")
    assert done.returncode != 0
    assert "unknown setting dlock_ttll (did you mean dlock_ttl?)" in done.stderr.decode()
