"""S3 against moto's server (``moto[server]``), a separate process on a loopback port that
handles one request at a time (``tests/support/moto_atomic.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_dlock.backends import backend_from_url
from tests.backends.storecase import StoreCase
from tests.support.objectstore_servers import session_server, unique_prefix

NAME = "s3"
#: A URL of this kind whose store cannot be reached (or made), with a password where the
#: scheme has one: ``from_url`` must accept it without I/O (contract).
UNREACHABLE = "s3://AKIA:s3cret@bucket/p?endpoint_url=http://127.0.0.1:1&region=x"


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    url = session_server(request, "moto").url(unique_prefix())
    yield StoreCase(
        backend=backend_from_url(url), url=url, clock=None, second=lambda: backend_from_url(url)
    )
