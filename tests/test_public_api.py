from __future__ import annotations
import __future__

import types

import celery_dlock


def test_all_names_exactly_the_public_api() -> None:
    public = {
        name
        for name, value in vars(celery_dlock).items()
        if not name.startswith("_")
        and not isinstance(value, (types.ModuleType, __future__._Feature))
    }
    assert set(celery_dlock.__all__) - {"__version__"} == public | set(celery_dlock._LAZY_NAMES)
    assert len(celery_dlock.__all__) == len(set(celery_dlock.__all__))


def test_the_documented_entry_points_are_there() -> None:
    for name in (
        "lock",
        "Lock",
        "backend_from_url",
        "LockBackend",
        "Lease",
        "Record",
        "Holder",
        "Outcome",
        "LockNotAcquiredError",
        "LockTimeoutError",
        "LockLostError",
        "BackendError",
        "ConfigurationError",
        "LockKeyError",
        "UnknownBackendError",
        "MissingDependencyError",
        "DLockError",
    ):
        assert name in celery_dlock.__all__, name
        assert getattr(celery_dlock, name) is not None


def test_importing_the_package_imports_no_driver() -> None:
    import subprocess
    import sys

    code = (
        "import sys, celery_dlock\n"
        "loaded = [m for m in ('psycopg', 'redis', 'boto3', 'google.cloud.storage', 'celery')"
        " if m in sys.modules]\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_a_missing_optional_package_is_named_with_its_extra() -> None:
    """Found by trying the wheel without extras: ``from celery_dlock import LockedTask``
    without Celery, and ``metrics.enable()`` without prometheus_client, raised a bare
    ModuleNotFoundError naming neither the extra nor what needed it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['celery'] = sys.modules['prometheus_client'] = None  # not installed\n"
        "import celery_dlock, celery_dlock.metrics\n"
        "for use in (lambda: celery_dlock.LockedTask, celery_dlock.metrics.enable):\n"
        "    try:\n"
        "        use()\n"
        "    except ModuleNotFoundError as exc:\n"
        "        print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    assert "LockedTask needs Celery" in lines[0] and "celery-dlock[celery]" in lines[0]
    assert "prometheus_client" in lines[1] and "celery-dlock[metrics]" in lines[1]
