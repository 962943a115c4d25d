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
