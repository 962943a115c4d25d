"""Test-wide setup; the test support shared by every directory is ``tests.support``."""

from __future__ import annotations

try:
    import celery  # noqa: F401
except ImportError:  # the Celery tests then skip; the core tests still run
    pytest_plugins: tuple[str, ...] = ("tests.support.exclusive",)
else:
    # Celery's classic fixtures (celery_app, celery_worker, celery_session_worker...).
    # pytest-celery 1.x, if installed, shadows celery_worker with a Docker worker: pyproject
    # disables it (-p no:celery) and tests/celery/conftest.py re-exports the classic one.
    pytest_plugins = ("tests.support.exclusive", "celery.contrib.pytest")
