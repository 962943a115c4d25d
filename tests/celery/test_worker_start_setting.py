"""A worker whose ``dlock_backend`` names no store stops at its start with the store's own
error (``UnknownBackendError``), and what it prints names the setting and its URL, password
masked. A real ``celery worker`` process on the test app."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.celery.test_worker_start import (
    test_a_worker_with_a_bad_lock_store_url_refuses_to_start as refuses_to_start,
)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came in Python 3.11")
def test_a_worker_given_an_unknown_store_scheme_names_the_setting(
    tmp_path: Path, redis_url: str
) -> None:
    url, shown = "postgress://app:s3cret@127.0.0.1/test", "postgress://app:***@127.0.0.1/test"
    refuses_to_start(tmp_path, redis_url, url, f"dlock_backend = {shown}")
