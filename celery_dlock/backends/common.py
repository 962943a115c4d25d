"""What the store implementations share beside the contract: objects made once per
process (the one fork-safety mechanism), expiry arithmetic, the record of a retry's
takeover, the count of a dead lease taken over, and URL options; and, for the stores' users
(the janitor, the CLI), now on a store's clock."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Any, ClassVar, Generic, TypeVar
from urllib.parse import parse_qsl

from celery_dlock import metrics
from celery_dlock.backends.base import LockBackend, server_time
from celery_dlock.errors import ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record

__all__ = [
    "LoopLocal",
    "LoopOwned",
    "ProcessLocal",
    "expired",
    "expiry",
    "flag",
    "retried",
    "retried_details",
    "store_now",
    "taken_over",
    "url_options",
    "wall_clock",
    "weakly",
]

T = TypeVar("T")
#: This process's id, set again first thing in a forked child (``_after_fork_in_child``):
#: ``ProcessLocal.get`` compares it rather than making a ``getpid`` system call each time.
_pid = os.getpid()


class ProcessLocal(Generic[T]):
    """An object made lazily, once per process id: the one fork-safety mechanism.

    Celery forks its pool after the app is imported; a socket or file inherited from the
    parent would be shared by both processes. ``get()`` makes a fresh object in a child
    and drops (without closing) the parent's copy, which still belongs to the parent.
    ``forget``, if given, is called on that copy in the child right after the fork, before
    anything else runs there: for objects whose destruction would speak on the parent's
    sockets (a psycopg connection says goodbye to the server when collected).
    """

    _forgetting: ClassVar[weakref.WeakSet[ProcessLocal[Any]]] = weakref.WeakSet()

    def __init__(
        self,
        factory: Callable[[], T],
        close: Callable[[T], None] | None = None,
        forget: Callable[[T], None] | None = None,
    ) -> None:
        self._factory = factory
        self._close = close
        self._forget = forget
        self._pid = -1
        self._value: T | None = None
        self._mutex = threading.Lock()
        if forget is not None:
            ProcessLocal._forgetting.add(self)

    @classmethod
    def _after_fork_in_child(cls) -> None:
        global _pid
        _pid = os.getpid()
        for local in list(cls._forgetting):
            local._mutex = threading.Lock()  # another thread may have held it at the fork
            value = local._value
            if value is not None and local._forget is not None and local._pid != os.getpid():
                local._forget(value)

    def get(self) -> T:
        value = self._value
        if value is not None and self._pid == _pid:
            return value
        with self._mutex:
            if self._value is None or self._pid != _pid:
                self._value = self._factory()
                self._pid = _pid
            return self._value

    def reset(self) -> None:
        """Close this process's object, if any; the next ``get()`` makes a new one."""
        with self._mutex:
            value, self._value = self._value, None
            if value is not None and self._pid == _pid and self._close is not None:
                self._close(value)


os.register_at_fork(after_in_child=ProcessLocal._after_fork_in_child)


class LoopOwned:
    """What a store makes for one event loop, its connections: closed by ``aclose`` when the
    loop shuts down (its ``shutdown_asyncgens``, which ``asyncio.run`` calls), or, while the
    loop runs on, when the store that made it is collected (``LoopLocal``)."""

    _keeper: AsyncGenerator[None, None] | None = None

    async def keep(self) -> None:
        """Have ``aclose`` called at the loop's shutdown: once, before the first connection."""
        if self._keeper is None:
            self._keeper = self._kept()
            await anext(self._keeper)

    async def _kept(self) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close what is open: harmless again, and beside another call of it."""
        raise NotImplementedError


L = TypeVar("L", bound=LoopOwned)
#: What each loop's stores made for it, kept by the loop (weakly keyed) as much as by its
#: store: the garbage collector never tears down the connections of a live loop, which would
#: finalize them (a ResourceWarning each) before their keeper could close them.
_kept: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[LoopOwned]]
_kept = weakref.WeakKeyDictionary()
_kept_mutex = threading.Lock()
_closing: set[asyncio.Task[None]] = set()  # the loop holds tasks only weakly


def _new_kept_mutex() -> None:
    global _kept_mutex
    _kept_mutex = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_new_kept_mutex)


class LoopLocal(Generic[L]):
    """An object made lazily once per running event loop, and per process: an asyncio
    connection belongs to the loop that opened it (and a forked child makes its own).
    Collected with its store while a loop runs on, it has that loop's object closed by a
    task of the loop."""

    def __init__(self, factory: Callable[[], L]) -> None:
        self._factory = factory
        self._made: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[int, L]]
        self._made = weakref.WeakKeyDictionary()
        weakref.finalize(self, _close_soon, self._made).atexit = False

    def get(self) -> L:
        """The running loop's object (made now if it has none)."""
        loop = asyncio.get_running_loop()
        found = self._made.get(loop)
        if found is None or found[0] != os.getpid():
            value = self._factory()
            with _kept_mutex:
                _kept.setdefault(loop, set()).add(value)
            found = self._made[loop] = (os.getpid(), value)
        return found[1]

    def values(self) -> list[L]:
        """The objects of this process's loops that are still alive."""
        pid = os.getpid()
        return [value for owner, value in list(self._made.values()) if owner == pid]

    def close(self) -> None:
        """Have this process's objects closed, each by a task of its loop; a later ``get``
        makes a new one (a store closed and used again connects again)."""
        _close_soon(self._made)
        self._made.clear()


def _close_soon(made: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[int, L]]) -> None:
    """Have what a ``LoopLocal`` made closed, each by a task of its loop: called from any
    thread (``close()``'s, or the collector's as it collects the ``LoopLocal``). A loop
    closed since runs nothing more."""
    for loop, (owner, value) in list(made.items()):
        if owner == os.getpid():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_close, loop, value)


def _close(loop: asyncio.AbstractEventLoop, value: LoopOwned) -> None:
    task = loop.create_task(value.aclose())
    _closing.add(task)
    task.add_done_callback(partial(_closed, loop, value))


def _closed(loop: asyncio.AbstractEventLoop, value: LoopOwned, task: asyncio.Task[None]) -> None:
    _closing.discard(task)
    with _kept_mutex:
        _kept.get(loop, set()).discard(value)


def weakly(callback: Callable[[Lease], None]) -> Callable[[Lease], None]:
    """``callback`` as a store's watcher keeps it: a bound method (a ``Lock``'s) without
    keeping its object alive, so that a Lock dropped while it holds its lease is collected
    and its lease released (``Lock.__del__``), not kept until the process ends."""
    if not inspect.ismethod(callback):
        return callback
    ref = weakref.WeakMethod(callback)

    def call(lease: Lease) -> None:
        method = ref()
        if method is not None:
            method(lease)

    return call


def expired(lease: Lease, now: float) -> bool:
    """Whether ``lease`` has run past its expiry at time ``now``."""
    return lease.expires_at is not None and lease.expires_at <= now


def retried(lease: Lease, successor: Holder, now: float) -> Record:
    """The record of ``lease`` taken over by ``successor``, the retry of its own task."""
    return Record(lease, now, Outcome.RETRIED, None, retried_details(successor))


def retried_details(successor: Holder) -> str:
    """The details recorded on a lease taken over by ``successor``, its own task's retry."""
    return f"continued by its retry: {successor.describe()}"


def taken_over(outcome: str | None) -> None:
    """Count the lease an acquire recorded as it took its key over, if it was dead
    (``disconnected``, ``expired``), in ``dlock_reaped_total`` as the janitor counts those it
    reaps: a redelivered task takes its killed predecessor's key before any janitor runs.
    A lease continued by its own task's retry (``retried``) is no death; None: none taken."""
    if outcome in (Outcome.DISCONNECTED, Outcome.EXPIRED):
        metrics.reaped(Outcome(outcome).value)


def expiry(now: float, ttl: float | None) -> float | None:
    return None if ttl is None else now + ttl


def wall_clock() -> float:
    return time.time()


def store_now(backend: LockBackend) -> float:
    """Now, on the store's clock where it has one (leases carry the store's times)."""
    server = server_time(backend)
    return time.time() if server is None else server


def flag(text: str) -> bool:
    """A boolean URL option: ``1/true/yes/on`` or ``0/false/no/off``."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def url_options(
    backend: str,
    query: str,
    known: dict[str, Callable[[str], Any]],
    overrides: dict[str, Any],
) -> dict[str, Any]:
    """Options from a URL query string, converted, with ``overrides`` on top.

    Raises:
        ConfigurationError: an option is unknown, repeated or has a bad value; the message
            names the option and the known ones.
    """
    options: dict[str, Any] = {}
    pairs = parse_qsl(query, keep_blank_values=True)
    for name, text in pairs:
        if name not in known:
            raise ConfigurationError(
                f"unknown option {name!r} in the {backend} backend URL "
                f"(known: {', '.join(sorted(known)) or 'none'})"
            )
        if name in options:
            raise ConfigurationError(f"option {name!r} is given twice in the {backend} URL")
        try:
            options[name] = known[name](text)
        except ValueError as exc:
            raise ConfigurationError(
                f"bad value {text!r} for option {name!r} of the {backend} backend: {exc}"
            ) from None
    for name, value in overrides.items():
        if name not in known:
            raise ConfigurationError(
                f"unknown option {name!r} for the {backend} backend "
                f"(known: {', '.join(sorted(known)) or 'none'})"
            )
        options[name] = value
    return options
