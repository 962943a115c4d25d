from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import celery_dlock
from celery_dlock import (
    ConfigurationError,
    MissingDependencyError,
    UnknownBackendError,
    backend_from_url,
    mask_url,
)
from celery_dlock.backends import BACKENDS, backend_class
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.memory import MemoryBackend


def test_unknown_scheme_suggests_the_closest_one() -> None:
    with pytest.raises(UnknownBackendError) as info:
        backend_from_url("postgress://localhost/db")
    assert info.value.scheme == "postgress"
    assert info.value.suggestion in ("postgres", "postgresql")
    assert "did you mean" in str(info.value)


def test_unknown_scheme_without_a_near_match_lists_nothing_wrong() -> None:
    with pytest.raises(UnknownBackendError, match="no lock backend for URL scheme 'zzzz'"):
        backend_from_url("zzzz://x")


@pytest.mark.parametrize("url", ["", "localhost:5432", "file:/tmp/x", None])
def test_malformed_url_is_refused_with_the_schemes(url: str) -> None:
    with pytest.raises(ConfigurationError, match="scheme://"):
        backend_from_url(url)


@pytest.mark.parametrize(
    ("url", "driver", "extra"),
    [
        ("postgresql://localhost/test", "psycopg", "postgres"),
        ("redis://localhost:6379/0", "redis", "redis"),
        ("gs://bucket/prefix", "google", "gcs"),
        ("s3://bucket/prefix", "boto3", "s3"),
    ],
)
def test_missing_driver_names_the_extra(url: str, driver: str, extra: str) -> None:
    # A fresh interpreter where the driver cannot be imported, as on a machine without it.
    code = (
        "import sys\n"
        f"sys.modules[{driver!r}] = None\n"
        "from celery_dlock import backend_from_url, MissingDependencyError\n"
        "try:\n"
        f"    backend_from_url({url!r})\n"
        "except MissingDependencyError as exc:\n"
        "    print(exc.module, exc.extra)\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    first, message = result.stdout.splitlines()[:2]
    assert first == f"{driver} {extra}"
    assert f"pip install 'celery-dlock[{extra}]'" in message


def test_missing_dependency_error_is_an_import_error() -> None:
    assert issubclass(MissingDependencyError, ImportError)


def test_every_registered_backend_module_exists() -> None:
    root = Path(celery_dlock.__file__).parent
    for target, _ in BACKENDS.values():
        module = target.split(":")[0].split(".")[-1]
        backends = root / "backends"
        assert (backends / f"{module}.py").exists() or (backends / module).is_dir(), target


def test_memory_urls_share_a_store_per_name() -> None:
    first = backend_from_url("memory://registry-test")
    assert isinstance(first, MemoryBackend)
    assert backend_from_url("memory://registry-test") is first
    assert backend_from_url("memory://registry-other") is not first


def test_file_url_gives_a_file_backend(tmp_path: Path) -> None:
    backend = backend_from_url(f"file://{tmp_path}/locks?fsync=1&gc_after=60")
    assert isinstance(backend, FileBackend)
    assert backend.fsync is True and backend.gc_after == 60.0
    assert backend.directory == f"{tmp_path}/locks"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file://relative/dir", "host part 'relative'"),
        ("file:///", "names no directory"),
        ("file:///tmp/x?fsync=maybe", "bad value 'maybe' for option 'fsync'"),
        ("file:///tmp/x?colour=red", "unknown option 'colour'.*known: fsync, gc_after"),
        ("file:///tmp/x?fsync=1&fsync=0", "given twice"),
    ],
)
def test_bad_file_urls_name_the_problem(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        backend_from_url(url)


@pytest.mark.parametrize(
    ("url", "argument", "message"),
    [
        ("redis://cache:6379/0", "redis://cache:6379/0", "connection settings as a dict"),
        ("s3://b/p", "s3://b/p", "takes a bucket's name, not 's3://b/p'"),
        ("s3://b/p", "b/p", "takes a bucket's name, not 'b/p'"),
        ("gs://b/p", "gs://b/p", "takes a bucket's name, not 'gs://b/p'"),
        ("gs://b/p", "", "takes a bucket's name, not ''"),
        ("file:///tmp/x", "file:///tmp/x", "needs an absolute directory"),
    ],
)
def test_a_constructor_given_a_url_or_a_path_names_the_problem(
    url: str, argument: str, message: str
) -> None:
    # The constructors take a bucket's name or driver settings; a URL is from_url's.
    cls = backend_class(url)
    with pytest.raises(ConfigurationError, match=message) as info:
        cls(argument)
    assert "from_url" in str(info.value) or "a URL looks like" in str(info.value)


def test_option_override_must_be_known(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="unknown option 'colour'"):
        backend_from_url(f"file://{tmp_path}", colour="red")


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://app:s3cret@db:5432/x", "postgresql://app:***@db:5432/x"),
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        (
            "postgresql://app:p%40ss@[::1]/x?sslmode=require",
            "postgresql://app:***@[::1]/x?sslmode=require",
        ),
        ("file:///var/lib/dlock", "file:///var/lib/dlock"),
        # found by trying the CLI: libpq's password option printed in full, page included
        (
            "postgresql://app@db/x?schema=s&password=s3cret&sslpassword=s3cret",
            "postgresql://app@db/x?schema=s&password=***&sslpassword=***",
        ),
        ("s3://AK@b/p?secret_key=s3cret&region=r", "s3://AK@b/p?secret_key=***&region=r"),
        ("postgresql://app:s3cret@db/x?password=s3cret", "postgresql://app:***@db/x?password=***"),
        # found by trying (Redis): a password's '#', '/' or '?' not percent-encoded ends the
        # URL's authority early, and the password printed in full
        ("postgresql://app:s3#cret@db/x", "postgresql://***@db/x"),
        ("s3://AK:s3/cret@b/p", "s3://***@b/p"),
        ("redis://:s3?cret@cache:6379/0", "redis://***@cache:6379/0"),
    ],
)
def test_mask_url_hides_passwords(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert "s3cret" not in mask_url(url)
