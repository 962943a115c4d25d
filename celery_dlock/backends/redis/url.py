"""Redis URLs: ``redis://``, ``rediss://`` and ``unix://`` to connection settings (for
redis-py) and backend options, every mistake named in a :class:`ConfigurationError`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from celery_dlock.backends import mask_url
from celery_dlock.backends.common import flag, url_options
from celery_dlock.errors import ConfigurationError

__all__ = ["parse_url"]

_TLS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
_CONNECTION = ("socket_timeout", "socket_connect_timeout")


def _cert_reqs(text: str) -> str:
    # redis-py checks it only when it connects: every task failed, and the worker ran on.
    if text not in ("none", "optional", "required"):
        raise ValueError("must be none, optional or required")
    return text


_KNOWN: dict[str, Callable[[str], Any]] = {
    "prefix": str,
    "buckets": int,
    "history_maxlen": int,
    "success_ttl": float,
    "gc_after": float,
    "restart_delay": float,
    "ttl": float,
    "retries": int,
    "replicas": int,
    "replicas_timeout": float,
    "socket_timeout": float,
    "socket_connect_timeout": float,
    "db": int,
    "ssl_ca_certs": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": _cert_reqs,
    "ssl_check_hostname": flag,
}


def parse_url(url: str, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(connection, options)`` for ``url``: redis-py keyword arguments, and the backend's
    own options (``prefix``...), with ``overrides`` on top of the URL's query.

    Raises:
        ConfigurationError: the URL is malformed or names an unknown or misplaced option.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    shown = mask_url(url)
    if "@" not in parts.netloc and "@" in url.partition("://")[2]:
        raise ConfigurationError(
            f"redis URL {shown!r} holds an '@' after its host: percent-encode a '/', '?' or "
            "'#' in its password (%2F, %3F, %23) and an '@' in an option (%40)"
        )
    if parts.fragment:
        raise ConfigurationError(f"redis URL {shown!r} has a '#' part, which means nothing")
    if scheme == "redis+cluster":
        return _cluster(parts, shown, overrides)
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigurationError(f"not a redis URL: {shown!r}")
    options = url_options("redis", parts.query, _KNOWN, overrides)
    connection = _timeouts(options)
    tls = {name: options.pop(name) for name in _TLS if name in options}
    if tls and scheme != "rediss":
        raise ConfigurationError(
            f"options {', '.join(sorted(tls))} need a rediss:// URL, not {scheme}://"
        )
    db = options.pop("db", None)
    if parts.username:
        connection["username"] = unquote(parts.username)
    if parts.password:
        connection["password"] = unquote(parts.password)
    if scheme == "unix":
        path = unquote(parts.path)
        if parts.hostname or not path:
            raise ConfigurationError(
                f"a unix socket URL looks like unix:///path/to/redis.sock?db=1, not {shown!r}"
            )
        connection["unix_socket_path"] = path
    else:
        try:
            port = parts.port
        except ValueError:
            raise ConfigurationError(f"bad port in redis URL {shown!r}") from None
        connection["host"] = parts.hostname or "localhost"
        connection["port"] = port or 6379
        path = parts.path.strip("/")
        if path:
            if db is not None:
                raise ConfigurationError(f"redis URL {shown!r} gives db twice")
            if not path.isdigit():
                raise ConfigurationError(f"the path of redis URL {shown!r} must be a db number")
            db = int(path)
        if scheme == "rediss":
            connection.update(ssl=True, **tls)
    if db is not None and db < 0:
        raise ConfigurationError(f"db must be >= 0, not {db}")
    connection["db"] = db or 0
    return connection, options


def _timeouts(options: dict[str, Any]) -> dict[str, Any]:
    """The socket timeouts taken out of ``options``, each checked positive (a 0 made every
    call fail with "Resource temporarily unavailable")."""
    timeouts = {name: options.pop(name) for name in _CONNECTION if name in options}
    for name, seconds in timeouts.items():
        if not seconds > 0:
            raise ConfigurationError(f"{name} must be positive seconds, not {seconds!r}")
    return timeouts


def _cluster(
    parts: SplitResult, shown: str, overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``redis+cluster://[[user]:password@]host:port[,host:port...][/0][?options]``: the
    nodes to learn the cluster from; ``buckets`` defaults to 16 (history and index spread
    over 16 slots)."""
    options = url_options("redis", parts.query, _KNOWN, overrides)
    connection = _timeouts(options)
    if any(name in options for name in _TLS) or options.pop("db", 0):
        raise ConfigurationError(f"a cluster has database 0 only and no TLS here: {shown!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    if user:
        connection["username"] = unquote(user)
    if password:
        connection["password"] = unquote(password)
    nodes = []
    for node in hosts.split(","):
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"a redis+cluster URL names its nodes as host:port,host:port, not {shown!r}"
            )
        nodes.append((host.strip("[]"), int(port)))
    if parts.path.strip("/") not in ("", "0"):
        raise ConfigurationError(f"a cluster has database 0 only: {shown!r}")
    connection["cluster_nodes"] = nodes
    options.setdefault("buckets", 16)
    return connection, options
