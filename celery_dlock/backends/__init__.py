"""Backend registry: URL scheme -> ``"module:Class"``, imported only when asked for.

No backend is imported here, so ``import celery_dlock`` needs no driver. An unknown scheme
gets a "did you mean" hint; a missing driver names the extra that installs it.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from celery_dlock.backends.base import Capabilities, LockBackend
from celery_dlock.errors import ConfigurationError, MissingDependencyError, UnknownBackendError

__all__ = [
    "BACKENDS",
    "Capabilities",
    "LockBackend",
    "backend_class",
    "backend_from_url",
    "mask_url",
    "query_secrets",
]

#: scheme -> (``"module:Class"``, package extra that installs its driver)
BACKENDS: dict[str, tuple[str, str | None]] = {
    "memory": ("celery_dlock.backends.memory:MemoryBackend", None),
    "file": ("celery_dlock.backends.file:FileBackend", None),
    "postgresql": ("celery_dlock.backends.postgres:PostgresBackend", "postgres"),
    "postgresql+psycopg": ("celery_dlock.backends.postgres:PostgresBackend", "postgres"),
    "postgres": ("celery_dlock.backends.postgres:PostgresBackend", "postgres"),
    "redis": ("celery_dlock.backends.redis:RedisBackend", "redis"),
    "rediss": ("celery_dlock.backends.redis:RedisBackend", "redis"),
    "unix": ("celery_dlock.backends.redis:RedisBackend", "redis"),
    "redis+cluster": ("celery_dlock.backends.redis:RedisBackend", "redis"),
    "gs": ("celery_dlock.backends.gcs:GCSBackend", "gcs"),
    "s3": ("celery_dlock.backends.s3:S3Backend", "s3"),
}


def _scheme(url: str) -> str:
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(
            f"a lock backend URL looks like 'scheme://...', got {url!r} "
            f"(schemes: {', '.join(sorted(BACKENDS))})"
        )
    if url.strip("\t\r\n") != url.strip():
        # A space around the URL, as an env file can leave: s3://locks/prod and
        # s3://locks/prod<space> were two stores, whose workers never saw each other's
        # locks. A tab or newline is fine: urlsplit drops them (a secret file's last "\n").
        raise ConfigurationError(
            f"the lock backend URL {mask_url(url)!r} has white space around it: remove it"
        )
    return url.split("://", 1)[0].lower()


def backend_class(url: str) -> type[LockBackend]:
    """The backend class that serves ``url``, imported now.

    Raises:
        UnknownBackendError: no backend for the URL's scheme.
        MissingDependencyError: the backend's driver is not installed.
    """
    scheme = _scheme(url)
    try:
        target, extra = BACKENDS[scheme]
    except KeyError:
        close = difflib.get_close_matches(scheme, BACKENDS, n=1)
        raise UnknownBackendError(scheme, close[0] if close else None) from None
    if scheme == "file" and sys.platform == "win32":
        raise ConfigurationError(
            "the file store needs POSIX file locks (flock), which Windows does not have: use "
            "memory:// within one process, or redis://, postgresql://, s3:// or gs://"
        )
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or "?"
        if extra is None or missing.startswith("celery_dlock"):
            raise
        raise MissingDependencyError(scheme, missing.split(".")[0], extra) from exc
    cls: type[LockBackend] = getattr(module, class_name)
    return cls


def backend_from_url(url: str, **options: Any) -> LockBackend:
    """A backend for ``url`` (``postgresql://...``, ``redis://...``, ``file:///dir``...).

    ``options`` are passed to the backend and win over the URL's query options.

    Raises:
        ConfigurationError: the URL is malformed or names an unknown option.
        UnknownBackendError: no backend for the URL's scheme.
        MissingDependencyError: the backend's driver is not installed.
    """
    return backend_class(url).from_url(url, **options)


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and output: the one in its
    user info (all before the last ``@`` when a password's ``/``, ``?`` or ``#`` was not
    percent-encoded), and any query option whose name says it is secret (``password``,
    ``sslpassword``, ``secret_key``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc and "@" in url.partition("://")[2]:
        # An '@' after the authority ended: a password holding a '/', '?' or '#' that is not
        # percent-encoded, which the parse above missed. All before the last '@' is hidden,
        # and what follows is masked as a URL's rest is.
        return f"{parts.scheme}://***@{_masked_tail(url)}"
    query = "&".join(_masked_option(option) for option in parts.query.split("&"))
    if parts.password is None:
        if query == parts.query:
            return url
        return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))
    userinfo, _, hosts = parts.netloc.rpartition("@")  # hosts: one, or a cluster's list
    netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _masked_tail(url: str) -> str:
    """What follows the last ``@`` of ``url``, its secret options masked. That ``@`` may
    instead be one in a secret option's value (``?password=p@ss``): the value's end,
    which starts the tail, is masked too."""
    tail = url.rpartition("@")[2]
    for secret in query_secrets(url):
        _, at, end = secret.rpartition("@")
        if at and tail.startswith(end):
            tail = "***" + tail[len(end) :]
    rest, question, query = tail.partition("?")
    if not question:
        return tail
    return f"{rest}?{'&'.join(_masked_option(option) for option in query.split('&'))}"


def _masked_option(option: str) -> str:
    name, equals, value = option.partition("=")
    return f"{name}=***" if equals and value and _secret(name) else option


def _secret(name: str) -> bool:
    return any(word in unquote(name).lower() for word in ("password", "secret"))


def query_secrets(url: str) -> list[str]:
    """The values of ``url``'s query options that :func:`mask_url` masks, as written."""
    try:
        query = urlsplit(url).query
    except ValueError:
        return []
    pairs = (option.partition("=") for option in query.split("&"))
    return [value for name, _, value in pairs if value and _secret(name)]
