"""What every CLI command runs in: the store it talks to, the namespace, and the guard that
turns failures into one masked line.

The store is resolved and opened on first use, so ``--help`` and usage errors never
connect. Every line the CLI prints goes through :meth:`Env.echo`, which masks the URL's
password wherever it appears (a driver may quote the URL in its own message).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import select
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar, cast
from urllib.parse import unquote, urlsplit

import click

from celery_dlock.backends import backend_from_url, mask_url, query_secrets
from celery_dlock.backends.base import LockBackend
from celery_dlock.errors import ConfigurationError, DLockError

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_PIPE",
    "Env",
    "Target",
    "UsageFailure",
    "failure_text",
    "guarded",
    "guarded_creating",
]

F = TypeVar("F", bound=Callable[..., Any])

_USERINFO = re.compile(r"://[^/?#@]*:([^/?#]*)@")

#: Control characters (C0 but newline and tab, DEL, C1), which a terminal acts on instead of
#: showing: in text from the store (a failure's message, a command's stderr tail, a task id
#: a caller chose) they could clear the screen, retitle the window or rewrite a line. Keys
#: cannot hold them (``validate_key``), so a key is still printed as it is given.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")

#: Exit code when the reader of our output went away (``| head``): 128 + SIGPIPE, what the
#: shell reports for ``cat``, ``grep`` or ``ls`` in the same place.
EXIT_PIPE = 141
#: Exit code after Ctrl-C (SIGINT): 128 + SIGINT, as the shell reports for its own commands.
EXIT_INTERRUPTED = 130


class UsageFailure(click.ClickException):
    """A wrong URL, option or setting: one ``Error:`` line and exit code 2, like click's
    own usage errors but without the usage text."""

    exit_code = 2


@dataclass(frozen=True, slots=True)
class Target:
    """Where the commands point.

    Attributes:
        url: the store's URL as given (with its password: never print it).
        source: where the URL came from (``--backend``, ``DLOCK_BACKEND``, ``dlock_backend``).
        namespace: the key prefix of the app (``job``), without the ``:``.
        janitor_interval: seconds between janitor runs, when known (under Celery).
        retention: seconds of history the janitor keeps, when known (under Celery).
    """

    url: str
    source: str
    namespace: str
    janitor_interval: float | None = None
    retention: float | None = None

    @property
    def prefix(self) -> str:
        """The key prefix of the namespace: ``job:`` (empty for no namespace)."""
        return f"{self.namespace}:" if self.namespace else ""


class Env:
    """The context object of the ``dlock`` and ``celery-dlock`` groups.

    Args:
        resolve: gives the :class:`Target`; called once, on first use (under Celery it
            reads the app's settings, which may raise ConfigurationError).
    """

    def __init__(self, resolve: Callable[[], Target]) -> None:
        self._resolve = resolve
        self._target: Target | None = None
        self._backend: LockBackend | None = None
        self._replacements: list[tuple[str, str]] = []
        self._streams: dict[bool, TextIO] = {}
        #: Whether the command may create a file store that is not there (``run``,
        #: ``migrate``); the others say that there is none.
        self.creates = False

    @property
    def target(self) -> Target:
        if self._target is None:
            self._target = self._resolve()
            self._replacements = _replacements(self._target.url)
        return self._target

    @property
    def url(self) -> str:
        """The store's URL with its password masked."""
        return mask_url(self.target.url)

    @property
    def backend(self) -> LockBackend:
        """The store, opened on first use and closed when the command ends."""
        if self._backend is None:
            if not self.creates:
                _require_file_store(self.target)
            self._backend = backend_from_url(self.target.url)
        return self._backend

    def close(self) -> None:
        """Close the store if it was opened; a failure to close changes nothing the
        command did, so it is not reported over the command's own result."""
        if self._backend is not None:
            backend, self._backend = self._backend, None
            with contextlib.suppress(Exception):
                backend.close()

    def scrub(self, text: str) -> str:
        """``text`` with the store URL's password replaced by ``***``."""
        for secret, mask in self._replacements:
            text = text.replace(secret, mask)
        return text

    def echo(self, text: str = "", *, err: bool = False, nl: bool = True) -> None:
        if err not in self._streams:
            self._streams[err] = _whole_writes(sys.stderr if err else sys.stdout)
        click.echo(_visible(self.scrub(text)), file=self._streams[err], nl=nl)

    def emit_json(self, data: Any) -> None:
        """``data`` as indented JSON with sorted keys, on stdout."""
        self.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _visible(text: str) -> str:
    """``text`` with each control character shown as its escape (``\\x1b``)."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def _replacements(url: str) -> list[tuple[str, str]]:
    """What :meth:`Env.scrub` replaces: the whole URL, then its password in each of the
    forms a message may quote it (as written, percent-decoded)."""
    pairs = [(url, mask_url(url))]
    try:
        password = urlsplit(url).password
    except ValueError:
        match = _USERINFO.search(url)
        password = match.group(1) if match else None
    if password:
        for form in dict.fromkeys((password, unquote(password))):
            pairs.append((f":{form}@", ":***@"))
            # A very short password would mask ordinary words; its URL forms are masked above.
            if len(form) >= 4:
                pairs.append((form, "***"))
    for secret in query_secrets(url):  # ?password=..., ?secret_key=...
        forms = dict.fromkeys((secret, unquote(secret)))
        pairs.extend((form, "***") for form in forms if len(form) >= 4)
    return pairs


def _require_file_store(target: Target) -> None:
    """Refuse a file store URL whose directory holds no store: opening it would create an
    empty one, and ``leases`` would report no leases in it (a mistyped path, or another
    user's default ``$TMPDIR/celery-dlock-<uid>``), ``doctor`` a healthy store.

    Raises:
        UsageFailure: the directory, or its ``locks`` directory, does not exist.
    """
    parts = urlsplit(target.url)
    path = unquote(parts.path)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not os.path.isabs(path):
        return  # not a file store, or a URL that backend_from_url refuses with its reason
    path = os.path.normpath(path)
    if os.path.isdir(os.path.join(path, "locks")):
        return
    what = "no such directory" if not os.path.exists(path) else "it has no locks directory"
    raise UsageFailure(
        f"no file store at {path} ({what}; the URL from {target.source}): is it the right "
        "store? Workers and `celery-dlock run` create it; this command does not"
    )


def _whole_writes(stream: TextIO) -> TextIO:
    """``stream``, or when it writes straight to its file (``PYTHONUNBUFFERED=1``,
    ``python -u``: Docker images set it) the same file through a buffered writer. An
    unbuffered text stream takes a short ``write(2)`` for a whole one: when the reader of a
    pipe went away (``| head``) in the middle of a long table, the rest was dropped with no
    error, and the command exited 0 where ``cat`` exits 141. A buffered writer writes the
    rest, and gets the ``EPIPE``."""
    if not isinstance(getattr(stream, "buffer", None), io.FileIO):
        return stream
    stream.flush()
    binary = open(stream.fileno(), "wb", closefd=False)  # noqa: SIM115 - kept by the Env
    return io.TextIOWrapper(
        binary, encoding=stream.encoding, errors=stream.errors, write_through=True
    )


def failure_text(exc: Exception) -> str:
    """One line for a failure: our own errors say what failed; others get their type.
    A driver's message over several lines (libpq's ``DETAIL:``...) is joined with ``; ``."""
    text = str(exc) if isinstance(exc, DLockError) else f"{type(exc).__name__}: {exc}"
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def guarded(command: F) -> F:
    """Run a command body with the group's :class:`Env` as first argument; turn every
    failure into one masked line (exit 2 for configuration, 1 for the rest) and close the
    store afterwards. A file store that is not there is not created: the command says so."""
    return _guarded(command, creates=False)


def guarded_creating(command: F) -> F:
    """:func:`guarded` for a command that may create the file store (``run``, ``migrate``)."""
    return _guarded(command, creates=True)


def _guarded(command: F, *, creates: bool) -> F:
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        env = click.get_current_context().find_object(Env)
        if env is None:
            raise click.UsageError("this command runs under `celery dlock` or `celery-dlock`")
        env.creates = creates
        try:
            return command(env, *args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own, about arguments: they never quote the URL
        except BrokenPipeError as exc:
            if not _output_gone():  # a store's socket, say: a failure like any other
                raise click.ClickException(env.scrub(failure_text(exc))) from None
            _silence_output()
            raise click.exceptions.Exit(EXIT_PIPE) from None
        except KeyboardInterrupt:
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except ConfigurationError as exc:
            raise UsageFailure(env.scrub(failure_text(exc))) from None
        except Exception as exc:
            raise click.ClickException(env.scrub(failure_text(exc))) from None
        finally:
            env.close()

    return cast(F, run)


def _output_gone() -> bool:
    """True when our stdout or stderr is a pipe or socket whose reader has gone (poll(2)
    reports POLLERR on the writing end of a pipe nobody reads)."""
    if not hasattr(select, "poll"):  # Windows: an EPIPE there is the output's anyway
        return True
    poller = select.poll()
    for fd in (1, 2):
        poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _silence_output() -> None:
    """Point stdout and stderr at the null device, so that nothing more is written to the
    gone reader (Python flushes both at exit, which would fail and print a traceback)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
