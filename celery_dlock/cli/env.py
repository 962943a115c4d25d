"""What every CLI command runs in: the store it talks to, the namespace, and the guard that
turns failures into one masked line.

The store is resolved and opened on first use, so ``--help`` and usage errors never
connect. Every line the CLI prints goes through :meth:`Env.echo`, which masks the URL's
password wherever it appears (a driver may quote the URL in its own message).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast
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
]

F = TypeVar("F", bound=Callable[..., Any])

_USERINFO = re.compile(r"://[^/?#@]*:([^/?#]*)@")

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
        click.echo(self.scrub(text), err=err, nl=nl)

    def emit_json(self, data: Any) -> None:
        """``data`` as indented JSON with sorted keys, on stdout."""
        self.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


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


def failure_text(exc: Exception) -> str:
    """One line for a failure: our own errors say what failed; others get their type.
    A driver's message over several lines (libpq's ``DETAIL:``...) is joined with ``; ``."""
    text = str(exc) if isinstance(exc, DLockError) else f"{type(exc).__name__}: {exc}"
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def guarded(command: F) -> F:
    """Run a command body with the group's :class:`Env` as first argument; turn every
    failure into one masked line (exit 2 for configuration, 1 for the rest) and close the
    store afterwards."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        env = click.get_current_context().find_object(Env)
        if env is None:
            raise click.UsageError("this command runs under `celery dlock` or `celery-dlock`")
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
