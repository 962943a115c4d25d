"""``LockedTask``: the Celery base class that takes a per-resource lock around the body.

::

    @app.task(base=LockedTask, lock_key="order:{order_id}", once=True)
    def charge(order_id, amount): ...

Taken in the worker process that runs the body (``__call__``, once Celery pushed the
request), released there on every exit, recorded with the outcome. Options (task attributes):

``lock_key``            template (``"order:{order_id}"`` / ``"order:<order_id>"``) or callable
``lock_ttl``            seconds a lease lives unrenewed (default ``dlock_ttl``); renewed every
                        ttl/3 while the body runs
``lock_wait``           seconds to wait for a busy key before ``on_locked`` applies (default 0)
``on_locked``           ``"retry"`` (default: re-queue with jittered backoff, not counted in
                        ``max_retries``), ``"skip"`` (finish with result None, record
                        ``skipped``), ``"fail"`` (raise ``LockNotAcquiredError``), or a callable
                        ``(task, key, lease) -> result``
``once``                after one success on a key, later runs return the stored result
``lock_across_retries`` ``self.retry()`` keeps the lock for the next attempt (default True)
``on_lock_lost``        ``"log"`` (default) or ``"raise"`` (LockLostError in the body), or a
                        callable ``(task, lease)``
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from celery import Task
from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry

from celery_dlock import metrics
from celery_dlock.backends.base import validate_ttl
from celery_dlock.celery import busy, dedupe, once, replacing, signals, softlimit
from celery_dlock.celery.busy import BUSY_HEADER, RETRY_HEADER, header
from celery_dlock.celery.options import define
from celery_dlock.celery.outcomes import outcome_of, replaced_by, replacement, stored_result
from celery_dlock.celery.policies import Interrupter, call_policy
from celery_dlock.celery.retries import retry_arguments
from celery_dlock.celery.settings import enable_metrics, settings, warn_if_default_store
from celery_dlock.errors import (
    AlreadySucceededError,
    BackendError,
    ConfigurationError,
    LockKeyError,
    LockLostError,
    LockNotAcquiredError,
)
from celery_dlock.events import fields
from celery_dlock.keys import KeyTemplate
from celery_dlock.lock import DEFAULT, Lock
from celery_dlock.locks import Locks, lost_lease
from celery_dlock.records import REQUEUE, Holder, Lease, Outcome, describe_exception

__all__ = ["LockedTask"]

logger = logging.getLogger("celery_dlock.task")

#: A lease kept for a retry also gets this long, past the retry's countdown, before it
#: expires by itself if the retry never comes.
RETRY_GRACE = 300.0


class LockedTask(Task):  # type: ignore[misc]  # celery has no type hints
    """A Celery task that holds a lock on its key while its body runs."""

    abstract = True
    lock_key: ClassVar[str | Callable[..., Any] | None] = None
    lock_ttl: ClassVar[Any] = DEFAULT
    lock_wait: ClassVar[float | None] = 0.0
    on_locked: ClassVar[Any] = "retry"
    once: ClassVar[bool] = False
    lock_across_retries: ClassVar[bool] = True
    on_lock_lost: ClassVar[Any] = "log"
    #: First re-queue delay for a busy key (seconds); doubles up to ``lock_retry_backoff_max``.
    lock_retry_backoff: ClassVar[float] = 1.0
    lock_retry_backoff_max: ClassVar[float] = 60.0
    #: Re-queues for a busy key before giving up with LockNotAcquiredError; None: no limit.
    lock_retry_max: ClassVar[int | None] = None
    #: At most this many bodies at once per key, each in a slot of its own (``key#n``).
    lock_limit: ClassVar[int] = 1
    #: Enqueue-time de-duplication: None, "until_started" or "until_finished" (see dedupe).
    dedupe: ClassVar[str | None] = None
    #: A duplicate ``apply_async``: "return" the queued task's AsyncResult, "raise"
    #: DuplicateTaskError, or a callable ``(task, mark key, queued task id)``.
    on_duplicate: ClassVar[Any] = "return"
    #: A callable of the task's arguments giving the lease's metadata (a JSON object of at
    #: most 4 KiB, shown by ``leases`` and ``history``), or None.
    lock_metadata: ClassVar[Callable[..., Any] | None] = None
    #: Seconds a dedupe mark lives past its message's countdown; None: ``dlock_dedupe_ttl``.
    dedupe_ttl: ClassVar[float | None] = None
    throws: ClassVar[tuple[type[BaseException], ...]] = (LockNotAcquiredError,)
    Request: ClassVar[str] = "celery_dlock.celery.signals:LockedRequest"  # resends, see there

    _dlock_templates: ClassVar[tuple[KeyTemplate, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        signals.connect()
        throws = cls.throws if isinstance(cls.throws, (tuple, list)) else (cls.throws,)
        if LockNotAcquiredError not in throws:  # a task's own throws=(...) keeps ours
            cls.throws = (*filter(None, throws), LockNotAcquiredError)
        templates = define(cls, LockedTask)
        if templates is not None:  # None: an abstract base of the user's own
            cls._dlock_templates = templates

    # -- what the body sees --------------------------------------------------------------

    @property
    def lease(self) -> Lease | None:
        """The lease held for the running request (key, token, fence), or None."""
        lock: Lock | None = getattr(self.request, "dlock_lock", None)
        return None if lock is None else lock.lease

    @property
    def leases(self) -> list[Lease]:
        """Every lease held for the running request, in key order (several: templates)."""
        lock: Lock | Locks | None = getattr(self.request, "dlock_lock", None)
        if lock is None:
            return []
        if isinstance(lock, Locks):
            return lock.leases
        return [] if lock.lease is None else [lock.lease]

    @property
    def idempotency_key(self) -> str:
        """A key for the running request's effect outside any database we reach (a card
        gateway's ``Idempotency-Key`` header): derived from the task's name and its lock
        key only, so every duplicate and every retry of one logical operation has the same
        one, and no argument's value shows in it. With several templates, from every key
        in the templates' order (a transfer 1→2 is not one 2→1, nor one 1→3); with a
        ``lock_limit``, from the key, not the slot the run holds."""
        lease = self.lease
        if lease is not None and len(self._dlock_templates) == 1 and self.lock_limit == 1:
            key = lease.key
        else:
            args, kwargs = tuple(self.request.args or ()), dict(self.request.kwargs or {})
            namespace = settings(self.app).namespace
            bodies = (template.render(args, kwargs) for template in self._dlock_templates)
            key = "+".join(f"{namespace}:{body}" if namespace else body for body in bodies)
        digest = hashlib.sha256(f"{self.name}\n{key}".encode("utf-8", "surrogatepass"))
        return f"dlock-{digest.hexdigest()[:40]}"

    def record_success(self, connection: Any, result: Any) -> None:
        """Keep this run's success for ``once`` in the caller's own transaction, so that the
        effect and its memory commit or roll back together (Postgres store; ``connection``
        is a psycopg/psycopg2 connection or cursor, or a SQLAlchemy Session/Connection, on
        the lock store's database). Call it inside the transaction that writes the effect,
        with the value the body will return::

            with ledger.transaction() as cursor:
                cursor.execute("INSERT INTO charges ...")
                self.record_success(cursor, result)

        A duplicate whose lease outlived the first run's (a lost lease, a killed child)
        then finds the success at once, or has its own transaction refused.

        Raises:
            AlreadySucceededError: a success of this task on this key is kept already: the
                transaction must roll back (``LockedTask`` then replays the kept result).
            ConfigurationError: not a ``once`` task's body, or not the Postgres store.
        """
        lock: Lock | None = getattr(self.request, "dlock_lock", None)
        if not self.once:
            raise ConfigurationError(f"task {self.name}: record_success is for once=True tasks")
        if lock is None or lock.lease is None:
            raise ConfigurationError(
                f"task {self.name}: record_success is called from the body, while it holds "
                "its lease"
            )
        step = getattr(self.request, "dlock_step", None)  # a replacement's name: once.step
        lock.record_success(connection, stored_result(self.name, result), step)

    def lock_key_for(
        self,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        namespace: str | None = None,
    ) -> str:
        """The full key this task locks for these arguments (``job:order:42``); with
        several templates, the sorted keys joined by ``+``."""
        return "+".join(self.lock_keys_for(args, kwargs, namespace))

    def lock_keys_for(
        self,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        namespace: str | None = None,
    ) -> list[str]:
        """Every full key this task locks for these arguments, sorted."""
        if not self._dlock_templates:
            raise LockKeyError(f"task {self.name} has no lock_key")
        if namespace is None:
            namespace = settings(self.app).namespace
        args, kwargs = tuple(args or ()), kwargs or {}
        bodies = [template.render(args, kwargs) for template in self._dlock_templates]
        if len(bodies) == 1:  # the usual task: one key
            return [f"{namespace}:{bodies[0]}" if namespace else bodies[0]]
        return sorted({f"{namespace}:{body}" if namespace else body for body in bodies})

    def _metadata_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # From the class, not the instance: a function set there is not bound to the task.
        make = type(self).lock_metadata
        if make is None:
            return None
        if isinstance(make, staticmethod):
            make = make.__func__
        try:
            return make(*args, **kwargs)
        except Exception as exc:
            raise ConfigurationError(
                f"task {self.name}: lock_metadata failed ({type(exc).__name__}: {exc})"
            ) from exc

    # -- sending -------------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``; with ``dedupe``, nothing is sent while a message of this
        task and key is queued (see :mod:`celery_dlock.celery.dedupe`). A retry, a re-queue
        and an eager run are the same logical task and pass through; so does a message that
        is part of a workflow (see ``dedupe.in_workflow``)."""
        if not dedupe.guards(self, options, passing=(BUSY_HEADER,)):
            return super().apply_async(args, kwargs, task_id, **options)
        message = {**options, "task_id": task_id}
        return dedupe.send(
            self, tuple(args or ()), dict(kwargs or {}), message, super().apply_async
        )

    def revoke_queued(self, *args: Any, **kwargs: Any) -> str | None:
        """Revoke this task's message queued under a ``dedupe`` mark for these arguments,
        releasing the mark at once, without knowing the task's id (a plain ``revoke(id)``
        releases it from the worker that gets the broadcast: see ``celery.revoking``); the
        revoked task's id, or None if none was queued."""
        return dedupe.revoke_queued(self, args, kwargs)

    # -- running -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The worker's tracer pushed the real request before calling us; a direct call
        # did not, and gets the same minimal request Task.__call__ would give it.
        softlimit.ready()  # in a pool child: the store's steps guarded from here on
        request = self.request
        direct = request.called_directly
        if direct:
            _task_stack.push(self)
            self.push_request(args=args, kwargs=kwargs)
            request = self.request
        try:
            mark = None if self.dedupe is None else dedupe.mark_of(request)
            if mark is None:
                return self._run_locked(request, args, kwargs)
            run = functools.partial(self._run_locked, request, args, kwargs)
            return dedupe.run_marked(self, mark, run)
        finally:
            softlimit.lift()  # the lock released: a soft limit held back since the body ended
            if direct:
                self.pop_request()
                _task_stack.pop()

    def _run_locked(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        current = settings(self.app)
        warn_if_default_store(current)
        if current.metrics and not metrics.enabled():
            enable_metrics()
        keys = self.lock_keys_for(args, kwargs, current.namespace)
        ttl = current.ttl if self.lock_ttl is DEFAULT else validate_ttl(self.lock_ttl)
        holder = Holder.current(
            worker=getattr(request, "hostname", None),
            task_id=getattr(request, "id", None),
            task_name=self.name,
            metadata=self._metadata_for(args, kwargs),
        )
        interrupter = Interrupter() if self.on_lock_lost == "raise" else None
        on_lost = functools.partial(self._lease_lost, interrupter=interrupter)
        lock: Any
        single = len(keys) == 1  # else all or none; a set has no hand-over to a retry
        if single:
            lock = Lock(
                current.backend,
                keys[0],
                ttl,
                self.lock_wait,
                holder=holder,
                on_lost=on_lost,
                limit=self.lock_limit,
            )
        else:
            lock = Locks(current.backend, keys, ttl, self.lock_wait, holder=holder, on_lost=on_lost)
        try:  # an exception before the body's own ending (a soft limit) releases the lease
            try:
                lock.acquire(replace=header(request, RETRY_HEADER)) if single else lock.acquire()
            except LockNotAcquiredError as exc:
                if not busy.after_predecessor(self, lock, exc):
                    return busy.apply_policy(self, lock, exc)
            except BackendError as exc:
                if current.on_backend_error == "run":
                    logger.warning(
                        "lock store failed for %s, running %s[%s] UNLOCKED "
                        "(dlock_on_backend_error='run'): %s",
                        lock.key,
                        self.name,
                        holder.task_id,
                        exc,
                        extra=fields("ran_unlocked", key=lock.key, task_id=holder.task_id),
                    )
                    self._started(request)
                    return self.run(*args, **kwargs)
                busy.store_failed(self, exc)  # backing off as for a busy key
            request.dlock_lock = lock
            self._started(request)
            return self._body(lock, args, kwargs, interrupter)
        except BaseException as exc:  # a Retry: re-queued before its body (none held: nothing)
            self._finish(lock, outcome_of(exc), exc)
            raise
        finally:
            request.dlock_lock = None

    def _started(self, request: Any) -> None:
        """The body is about to run: an until_started mark ends, an until_finished one knows."""
        if self.dedupe is None:
            return  # no look at the request: a missing attribute costs an exception
        on_held = getattr(request, "dlock_on_held", None)
        if on_held is not None:
            on_held()

    def _body(self, lock: Lock, args: tuple[Any, ...], kwargs: dict[str, Any], raising: Any) -> Any:
        previous = once.kept_success(self, lock) if self.once else None
        if previous is not None and (previous := once.step(self, lock, previous)) is not None:
            return once.replay(lock, previous, self.request)
        try:
            result = softlimit.run_body(self, args, kwargs, raising)
        except Retry as exc:
            self._retrying(lock, exc)
            raise
        except AlreadySucceededError as exc:
            # record_success found another run's success in the body's transaction (rolled
            # back: no effect here): replay it (a store failing to give it: re-queued).
            mine = self.once and exc.key == lock.key
            previous = once.kept_success(self, lock, exc.task_name) if mine else None
            if previous is None:
                self._finish(lock, Outcome.FAILED, exc)
                raise
            return once.replay(lock, previous, self.request)
        except LockLostError as exc:
            held = lock.lease and lost_lease(lock)  # of a set: the key lost, not the first
            if exc.key or held is None:
                self._finish(lock, Outcome.FAILED, exc)
                raise
            named = LockLostError(held.key, held.fence, "renew")  # on_lock_lost="raise": a class
            self._finish(lock, Outcome.FAILED, named.with_traceback(exc.__traceback__))
            raise named from None
        except Ignore as exc:
            if (handed := replaced_by(self.request)) is None:
                self._finish(lock, outcome_of(exc), exc)
                raise
            # The body ended by sending its replacement: a success (for once too: a
            # duplicate must not run the body again and send a second replacement).
            kept = replacement(self.request) if self.once else None
            once.keep_step(self.request, lock, kept)
            self._finish(lock, Outcome.SUCCEEDED, None, kept, details=handed)
            raise
        except BaseException as exc:
            self._finish(lock, outcome_of(exc), exc)
            raise
        if lock.lost and self.on_lock_lost == "raise":  # released: a set's other keys too
            gone = lost_lease(lock)
            self._finish(lock, Outcome.FAILED, lost := LockLostError(gone.key, gone.fence, "renew"))
            raise lost
        stored = stored_result(self.name, result) if self.once else None
        if stored is not None:
            once.keep_step(self.request, lock, stored)
        self._finish(lock, Outcome.SUCCEEDED, None, stored)
        return result

    def _finish(
        self,
        lock: Lock,
        outcome: Outcome,
        exc: BaseException | None,
        result: Any = None,
        details: str | None = None,
    ) -> None:
        lease = lock.lease
        if lease is None:
            return
        problem, details = (None, details) if exc is None else describe_exception(exc)
        if isinstance(exc, Reject):
            details = f"{REQUEUE}{exc.requeue}: {details}"
        try:
            record = lock.release(outcome, problem, details, result)
        except BackendError:
            extra = fields("release_failed", lease, outcome=outcome)
            logger.exception(
                "could not release %s; tried again at this worker's next release (else the "
                "janitor clears it)",
                lease.key,
                extra=extra,
            )
            return
        if record is None and self.on_lock_lost == "raise" and exc is None:
            raise LockLostError(lease.key, lease.fence, "release")

    def _retrying(self, lock: Lock, exc: Retry) -> None:
        """The body called ``self.retry()``: keep the lease for the next attempt (which
        takes it over by token) or release it as ``retried``."""
        if lock.lease is None:
            return
        if not (self.lock_across_retries and getattr(self.request, "dlock_keep", False)):
            self._finish(lock, Outcome.RETRIED, exc)
            return
        when = exc.when
        countdown = when if isinstance(when, (int, float)) else self.default_retry_delay or 0
        if hasattr(when, "timestamp"):
            countdown = max(0.0, when.timestamp() - time.time())
        # Cover the wait for the retry with a backstop TTL, even on stores whose liveness is
        # a session: if the retry never comes, the key frees itself.
        lock.keep(float(countdown) + RETRY_GRACE)

    def on_replace(self, sig: Any) -> Any:
        """Celery's ``Task.replace`` sending ``sig`` in this run's place (under the task's
        own id), then raising ``Ignore``: the run is recorded ``succeeded``, naming ``sig``,
        a ``once`` task keeps that success (``once.continues``: what goes on, what replays),
        and an ``until_finished`` mark may go on with ``sig`` (``replacing.hand_mark``)."""
        if not self.request.is_eager and getattr(self.request, "dlock_lock", None) is not None:
            self.request.dlock_replaced_by = sig
            replacing.hand_mark(self, sig)
        return super().on_replace(sig)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry()``; with ``lock_across_retries`` the next attempt gets the
        token of this attempt's lease in a message header and takes the lease over."""
        lock: Lock | None = getattr(self.request, "dlock_lock", None)
        lease = None if lock is None else lock.lease
        if (
            lease is not None
            and self.lock_across_retries
            and isinstance(lock, Lock)
            and not self.request.called_directly  # no message: nothing would come back
            and self._retry_locks(lock.key, args, kwargs)
        ):
            headers = dict(kwargs.get("headers") or self.request.headers or {})
            headers[RETRY_HEADER] = lease.token
            kwargs["headers"] = headers
            self.request.dlock_keep = True
        return super().retry(*args, **kwargs)

    def _retry_locks(self, key: str, args: tuple[Any, ...], options: dict[str, Any]) -> bool:
        """Whether the retry that ``retry(*args, **options)`` sends locks ``key`` again (its
        arguments may name another key: then the lease is released, not kept)."""
        given = dict(zip(("args", "kwargs"), args, strict=False)) | options
        inherited = (tuple(self.request.args or ()), dict(self.request.kwargs or {}))
        sent = retry_arguments(self.run, inherited, given.get("args"), given.get("kwargs"))
        try:
            keys = self.lock_keys_for(*sent)
        except LockKeyError:
            return False
        return keys == [key]

    # -- a lost lease ------------------------------------------------------------------------

    def _lease_lost(self, lease: Lease, interrupter: Interrupter | None) -> None:
        """The Lock has logged the loss (naming this task, the lease's holder); apply the
        task's ``on_lock_lost`` policy ("raise": only while the body runs)."""
        policy = self.on_lock_lost
        if callable(policy):
            call_policy(self, "on_lock_lost", lease)
        elif interrupter is not None:
            interrupter.interrupt()
