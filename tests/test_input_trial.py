"""Bad input, tried where it enters: store URLs, ``dlock_*`` settings. Each is refused by
an error that names it, or works as written; a password shows nowhere, not even a piece.

Found by trying (each test failed before its fix):
- a Postgres URL whose password holds an ``@`` (``p@ss``) never connected: libpq ends the
  password at the first ``@`` and took ``ss@host`` for the host, showing ``ss`` in the
  error; a raw ``%`` in it failed with the whole password in the message;
- ``postgresql:///db?host=...`` (no host before the path, libpq's form for a Unix socket)
  was refused as ``missing "=" after "postgresql:/db"``;
- a password cut by a raw ``/``, ``?`` or ``#`` was taken (then a host lookup of the user
  name failed at first use) or refused as ``unknown option 'ss@...'``, a piece of it;
- a port that is no port was taken, and every task then failed at its connection;
- ``rediss://...?ssl_cert_reqs=require`` (not one of redis-py's words) was taken, and
  failed every call;
- ``memory://NAME/path`` was taken as ``memory://NAME``, another URL's store;
- a space around a URL (an env file's) made another store: ``file:///locks `` beside
  ``file:///locks``, another prefix on S3;
- a ``?password=`` option holding an ``@`` was masked as ``postgresql://***@ss``;
- the Postgres store's connection settings showed the password in their repr;
- ``dlock_history_retention``, ``dlock_janitor_interval`` and ``dlock_dedupe_ttl`` took NaN
  and infinity (a NaN retention then failed every janitor run on Redis, an infinite
  interval stopped beat at its start).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery import Celery

from celery_dlock import ConfigurationError, Holder, Outcome
from celery_dlock.backends import backend_from_url, mask_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.celery.settings import settings
from tests.support import unavailable
from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin

psycopg = pytest.importorskip("psycopg")

# -- settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["dlock_history_retention", "dlock_janitor_interval", "dlock_dedupe_ttl"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, 1e12])
def test_a_duration_setting_that_is_not_finite_is_refused_naming_it(
    name: str, value: float
) -> None:
    app = Celery("input-trial", set_as_current=False)
    app.conf.update({"dlock_backend": "memory://input-trial", name: value})
    with pytest.raises(ConfigurationError) as refused:
        settings(app)
    assert str(refused.value) == (
        f"{name} must be a positive number of seconds, at most 3155760000 (100 years), "
        f"not {value!r}"
    )


# -- store URLs -------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["memory://input-trial/one", "memory://input-trial#one"])
def test_a_memory_url_with_a_path_is_refused_not_taken_for_its_name_alone(url: str) -> None:
    """The path was ignored: memory://tests/one and memory://tests/two were one store, so
    tests meant to be apart shared their locks."""
    with pytest.raises(ConfigurationError, match="memory://NAME, with no path"):
        backend_from_url(url)
    assert backend_from_url("memory://input-trial/") is backend_from_url("memory://input-trial")


def test_a_url_with_a_space_around_it_is_refused_not_taken_for_another_store(
    tmp_path: Path,
) -> None:
    """An env file's trailing space made another store (``file:///locks`` beside
    ``file:///locks ``; on S3 another prefix), whose workers never saw the others' locks."""
    for url in (f"file://{tmp_path}/store ", f" file://{tmp_path}/store", "s3://bucket/prod "):
        with pytest.raises(ConfigurationError, match="has white space around it"):
            backend_from_url(url)
    assert list(tmp_path.iterdir()) == []  # no store made under a name with a space
    # a secret file's last newline is dropped by the URL parser, as before: the same store
    with backend_from_url(f"file://{tmp_path}/store\n") as backend:
        assert backend.try_acquire("job:input:newline", Holder.current(), None) is not None
    assert [path.name for path in tmp_path.iterdir()] == ["store"]


def test_a_bad_tls_requirement_of_a_redis_url_is_refused_when_the_url_is_read() -> None:
    """redis-py checks ``ssl_cert_reqs`` only as it connects: a worker started, and every
    task failed with a store error and was retried."""
    with pytest.raises(ConfigurationError, match=r"'ssl_cert_reqs' .* none, optional or requ"):
        backend_from_url("rediss://127.0.0.1/0?ssl_cert_reqs=require")
    backend_from_url("rediss://127.0.0.1/0?ssl_cert_reqs=required").close()


# -- passwords in URLs ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "pieces"),
    [
        ("postgresql://127.0.0.1/db?password=hunt@er22", ["er22"]),
        ("postgresql://127.0.0.1:5432/db?password=hunt@er22&sslmode=require", ["er22"]),
        ("postgresql://127.0.0.1/db?sslpassword=a@b@secret9&x=1", ["secret9", "b@"]),
        # a password cut by a raw '/': the option after it was shown as written
        ("redis://:pa/ss7wd@127.0.0.1/0?ssl_keyfile=k&password=zz9zz", ["zz9zz", "ss7wd"]),
    ],
)
def test_a_secret_holding_an_at_shows_no_piece_of_itself(url: str, pieces: list[str]) -> None:
    shown = mask_url(url)
    for piece in pieces:
        assert piece not in shown, shown
    assert "***" in shown


def test_a_password_option_holding_an_at_is_masked_in_the_backend_url() -> None:
    backend = backend_from_url("postgresql://127.0.0.1:1/db?password=hunt@er22")
    assert "er22" not in backend.url and "er22" not in repr(backend)
    backend.close()


def test_the_postgres_connection_settings_show_no_password_in_their_repr() -> None:
    """A debug log of the store's settings, or a traceback's locals, printed the URL with
    its password (the libpq conninfo)."""
    backend: Any = backend_from_url("postgresql://app:hunter22@127.0.0.1:1/db")
    assert "hunter22" not in repr(backend._config)
    backend.close()


@pytest.mark.parametrize(
    "password",
    ["Secr?etTail", "Secr/etTail", "Secr#etTail", "12?etTail", "12?schema=etTail"],
)
def test_a_password_cut_by_a_character_not_encoded_is_refused_showing_no_piece(
    password: str,
) -> None:
    url = f"postgresql://app:{password}@127.0.0.1/db?schema=s"
    with pytest.raises(ConfigurationError) as refused:
        backend_from_url(url)
    message = str(refused.value)
    assert "percent-encode a '/', '?' or '#' in its password" in message
    assert "etTail" not in message and "Secr" not in message


def test_an_s3_secret_key_cut_by_its_slash_is_named_not_a_missing_bucket() -> None:
    """AWS secret keys hold '/': one not percent-encoded was refused as naming no bucket."""
    with pytest.raises(ConfigurationError) as refused:
        backend_from_url("s3://AKIAEXAMPLE:wJalrXUtnFEMI/K7MDENGbPxRfiCY@bucket/prefix")
    message = str(refused.value)
    assert "percent-encode a '/', '?' or '#' in its secret key" in message
    assert "K7MDENG" not in message and "wJalr" not in message
    encoded = backend_from_url("s3://AKIAEXAMPLE:wJalrXUtnFEMI%2FK7MDENGbPxRfiCY@bucket/prefix")
    assert "K7MDENG" not in encoded.url
    backend_from_url("s3://bucket/prefix@2026").close()  # an '@' in a prefix is a prefix's
    encoded.close()


@pytest.mark.parametrize("port", ["99999", "abc", "0"])
def test_a_port_that_is_no_port_is_refused_when_the_url_is_read(port: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        backend_from_url(f"postgresql://app:hunter22@127.0.0.1:{port}/db")
    assert f"has the port {port!r}" in str(refused.value)
    assert "hunter22" not in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://h1:5432,h2:5433/db",
        "postgresql://h1:5432,h2/db",
        "postgresql://[::1]:5432/db",
        "postgresql://[::1]/db",
        "postgresql://%2Fvar%2Frun%2Fpostgresql/db",
        "postgresql://h:5432/db?user=me@corp",  # an '@' in an option's value, not a password
    ],
)
def test_the_host_forms_of_libpq_are_still_taken(url: str) -> None:
    backend_from_url(url).close()  # no I/O: from_url only reads the URL


# -- the same URLs reach a real server ---------------------------------------------------


def _server() -> tuple[str, str, str]:
    """``(host, port, dbname)`` of the test server, whose URL must give no password (the
    tests below write their own, which the test server's trust rule ignores)."""
    parts = urlsplit(POSTGRES_URL)
    if parts.password or parts.username != "postgres":
        unavailable("these tests need the default DLOCK_POSTGRES_URL (user postgres, trust)")
    return parts.hostname or "127.0.0.1", str(parts.port or 5432), parts.path.lstrip("/")


@contextmanager
def _store(url: str) -> Iterator[LockBackend]:
    """The store of ``url`` (with a schema of its own, made on first use), dropped after."""
    admin = postgres_admin()
    schema = f"dlock_t_{os.urandom(6).hex()}"
    backend = backend_from_url(f"{url}{'&' if '?' in url else '?'}schema={schema}&auto_migrate=1")
    try:
        yield backend
    finally:
        backend.close()
        drop_schema(admin, schema)
        admin.close()


def _takes_and_releases(backend: LockBackend, key: str) -> None:
    lease = backend.try_acquire(key, Holder.current(), None)
    assert lease is not None
    current = backend.get(key)
    assert current is not None and current.token == lease.token
    record = backend.release(lease, Outcome.SUCCEEDED)
    assert record is not None and backend.get(key) is None


@pytest.mark.parametrize("password", ["p@ss-w0rd", "50%off-now", "p%40ss:w0rd"])
def test_a_password_with_an_at_or_a_percent_reaches_the_server(password: str) -> None:
    host, port, dbname = _server()
    url = f"postgresql://postgres:{password}@{host}:{port}/{dbname}"
    with _store(url) as backend:
        assert password not in backend.url and "w0rd" not in backend.url
        assert "off-now" not in backend.url
        _takes_and_releases(backend, "job:input:password")


def test_a_url_with_no_host_before_the_path_reaches_the_server_named_in_its_options() -> None:
    """libpq's form for a Unix socket, ``postgresql:///db?host=/run/postgresql``, here with
    the test server's TCP host (a socket's peer rule would refuse root as ``postgres``)."""
    host, port, dbname = _server()
    with _store(f"postgresql:///{dbname}?host={host}&port={port}&user=postgres") as backend:
        _takes_and_releases(backend, "job:input:no-host")


def test_a_socket_url_gives_libpq_the_socket_directory() -> None:
    backend: Any = backend_from_url("postgresql:///app?host=/var/run/postgresql")
    assert psycopg.conninfo.conninfo_to_dict(backend._config.conninfo) == {
        "dbname": "app",
        "host": "/var/run/postgresql",
    }
    backend.close()
