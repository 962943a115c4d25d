"""Locks in a Google Cloud Storage bucket.

URL
    ``gs://bucket/prefix``, with Application Default Credentials. Example for a local
    emulator: ``gs://locks/prod?endpoint=http://127.0.0.1:4443&project=test&anonymous=1``.

Options
    ``endpoint`` (URL): another API endpoint (an emulator); ``STORAGE_EMULATOR_HOST`` is not
    needed and not read for it.
    ``project`` (id): the project for the client (default: from the credentials).
    ``anonymous`` (bool, default false): no credentials (emulators only).
    ``timeout`` (seconds, default 10): timeout of each request; retries of one call stop
    after three times that.
    ``gc_after`` (seconds, default 86400): ``reap()`` deletes lock objects free that long.
    ``ttl`` (seconds, default 60): the ttl of a lock given none, renewed every ``ttl / 3``.
    ``GCSBackend(..., clock=...)`` takes the local clock that measures time between responses.

Guarantees
    Mutual exclusion rests on uploads with ``ifGenerationMatch=0`` (create) and
    ``ifGenerationMatch=<generation>`` (swap). The janitor's collect (of keys idle past
    ``gc_after``) deletes with ``ifGenerationMatch``, which GCS honours (fake-gcs-server
    does not: its tests cannot show that race, see the tests). GCS allows about one write
    per second per object name, so these locks suit coarse work (cron singletons, batch
    jobs), not thousands of short critical sections a second on one key; keep ``ttl`` well
    above a few seconds.
    crash: a dead holder's lease expires ``ttl`` after its last renewal (by GCS's clock); a
    lock given no ``ttl`` gets the URL's (60 s by default), renewed while held.
    clock skew: expiry is judged by GCS's ``Date`` headers and the ``updated`` time of our
    own writes, never the caller's clock.
    partition: a holder cut off from GCS cannot renew; its lease expires, and its late
    writes fail their generation condition. Use the lease's fence to guard the resource.
    durability: lock objects and history are ordinary objects (GCS's durability).

Install
    ``pip install 'celery-dlock[gcs]'`` (google-cloud-storage).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote, urlsplit

import requests
from google.api_core import exceptions as google_errors
from google.api_core.retry import Retry
from google.auth import exceptions as auth_errors
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage  # type: ignore[import-untyped]  # no py.typed in the package
from google.cloud.storage.retry import DEFAULT_RETRY  # type: ignore[import-untyped]

from celery_dlock.backends import mask_url
from celery_dlock.backends.base import MonotonicClock
from celery_dlock.backends.common import flag, url_options
from celery_dlock.backends.objectstore import (
    Found,
    ObjectStore,
    ObjectStoreBackend,
    Stamp,
    UnsureWrite,
    Written,
)
from celery_dlock.backends.objectstore.store import DEFAULT_TTL, checked_option
from celery_dlock.errors import BackendError, ConfigurationError

__all__ = ["GCSBackend"]

_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
#: What the driver raises for a failed request: API errors (with an HTTP ``code``; also
#: ``RetryError`` when retries ran out), transport errors, credential errors.
_FAILURES = (google_errors.GoogleAPIError, requests.RequestException, auth_errors.GoogleAuthError)


class GCSBackend(ObjectStoreBackend):
    """Locks as objects in a GCS bucket, written only with generation preconditions."""

    name = "gcs"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        project: str | None = None,
        anonymous: bool = False,
        timeout: float = 10.0,
        gc_after: float = 86400.0,
        ttl: float = DEFAULT_TTL,
        clock: MonotonicClock | None = None,
    ) -> None:
        super().__init__(bucket, prefix, gc_after=gc_after, clock=clock)
        # A lease lives by its ttl alone here: a Lock without one gets this, renewed.
        self.default_ttl = float(checked_option("gcs", "ttl", ttl, least=0, above=True))
        if endpoint is not None and urlsplit(endpoint).scheme not in ("http", "https"):
            raise ConfigurationError(
                f"option 'endpoint' of the gcs backend must be an http:// or https:// URL, "
                f"not {endpoint!r}"
            )
        self.endpoint = endpoint
        self.project = project
        self.anonymous = anonymous
        self.timeout = float(checked_option("gcs", "timeout", timeout, least=0, above=True))
        self.url = f"gs://{bucket}/{self.prefix}"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> GCSBackend:
        parts = urlsplit(url)
        if not parts.netloc or "@" in parts.netloc or ":" in parts.netloc:
            raise ConfigurationError(
                f"GCS backend URL {mask_url(url)!r} names no bucket: use gs://bucket/prefix"
            )
        clock = options.pop("clock", None)
        known: dict[str, Callable[[str], Any]] = {
            "endpoint": str,
            "project": str,
            "anonymous": flag,
            "timeout": float,
            "gc_after": float,
            "ttl": float,
        }
        backend = cls(
            parts.netloc,
            unquote(parts.path),
            clock=clock,
            **url_options("gcs", parts.query, known, options),
        )
        backend.url = mask_url(url)
        return backend

    def _endpoint(self) -> str:
        return self.endpoint or "https://storage.googleapis.com"

    def _open_store(self) -> ObjectStore:
        session: requests.Session
        try:
            if self.anonymous:
                credentials: Any = AnonymousCredentials()  # type: ignore[no-untyped-call]
                session = requests.Session()
                project = self.project or "anonymous"
            else:
                import google.auth
                from google.auth.transport.requests import AuthorizedSession

                credentials, default_project = google.auth.default(scopes=[_SCOPE])
                session = AuthorizedSession(credentials)  # type: ignore[no-untyped-call]
                project = self.project or default_project or ""
            dates = _Dates()
            session.hooks["response"].append(dates.hook)
            options = None if self.endpoint is None else {"api_endpoint": self.endpoint}
            client = storage.Client(
                project=project, credentials=credentials, client_options=options, _http=session
            )
        except (auth_errors.GoogleAuthError, ValueError) as exc:
            raise ConfigurationError(f"cannot make a GCS client for {self.url}: {exc}") from exc
        # google-cloud-storage >= 3.x fetches bucket metadata from a background thread for
        # trace attributes (once per client, again after a 404): requests we do not need.
        if getattr(client, "_bucket_metadata_cache", None) is not None:
            client._bucket_metadata_cache = None
        return GCSStore(client, self.bucket, dates, self.timeout, self.url)


class _Dates:
    """The ``Date`` of the newest HTTP response of each thread (google-cloud-storage does
    not hand response headers to its callers; a requests hook sees every response)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def hook(self, response: requests.Response, *args: Any, **kwargs: Any) -> None:
        self._local.date = response.headers.get("Date")

    def clear(self) -> None:
        self._local.date = None

    def stamp(self, exact: Any = None) -> Stamp:
        text = getattr(self._local, "date", None)
        date = None
        if text:
            try:
                date = parsedate_to_datetime(text).timestamp()
            except (TypeError, ValueError):
                date = None
        return Stamp(date, None if exact is None else float(exact.timestamp()))


class GCSStore(ObjectStore):
    """One GCS bucket through google-cloud-storage. Driver errors become
    :class:`BackendError` here only."""

    def __init__(self, client: Any, bucket: str, dates: _Dates, timeout: float, where: str) -> None:
        self.client = client
        self.bucket = client.bucket(bucket)
        self.dates = dates
        self.timeout = timeout
        self.where = where
        #: A request succeeded on the bucket: it exists (``_check_bucket``).
        self._bucket_seen = False
        # Our writes are all conditional, so retrying any of them is safe; a retry of a
        # write that had landed gets 412, which the core settles by reading back. Lock
        # calls wait on this: first retry after 0.1 s (the library's default is 1 s).
        self.retry: Retry = DEFAULT_RETRY.with_timeout(3 * timeout).with_delay(
            initial=0.1, maximum=2.0, multiplier=2.0
        )

    def _failed(self, what: str, exc: Exception) -> BackendError:
        return BackendError(f"GCS {what} failed: {exc}", self.where)

    def read(self, name: str) -> Found:
        blob = self.bucket.blob(name)
        self.dates.clear()
        try:
            body = blob.download_as_bytes(timeout=self.timeout, retry=self.retry)
        except google_errors.NotFound:
            missing = Found(None, None, self.dates.stamp())
            self._check_bucket(name)
            return missing
        except _FAILURES as exc:
            raise self._failed(f"GET {name}", exc) from exc
        self._bucket_seen = True
        return Found(bytes(body), str(blob.generation), self.dates.stamp())

    def _check_bucket(self, name: str) -> None:
        """Make sure the bucket exists, once per process, after a read answered 404: GCS
        answers 404 alike for a missing object and a missing bucket, and a misspelt bucket
        must not look like a free key. A listing (which the janitor needs anyway) tells
        them apart by its own 404; one forbidden to these credentials proves nothing."""
        if self._bucket_seen:
            return
        try:
            for _ in self.client.list_blobs(
                self.bucket, prefix=name, max_results=1, timeout=self.timeout, retry=self.retry
            ):
                break
        except google_errors.NotFound as exc:
            raise self._no_bucket(exc) from exc
        except google_errors.Forbidden:
            pass
        except _FAILURES as exc:
            raise self._failed(f"LIST {name}", exc) from exc
        self._bucket_seen = True

    def _no_bucket(self, exc: Exception) -> BackendError:
        return BackendError(
            f"the GCS bucket {self.bucket.name!r} does not exist, or these credentials "
            f"cannot see it ({type(exc).__name__}: {getattr(exc, 'code', '')})",
            self.where,
        )

    def create(self, name: str, body: bytes) -> Written:
        return self._upload(name, body, 0)

    def swap(self, name: str, body: bytes, version: str) -> Written:
        return self._upload(name, body, int(version))

    def _upload(self, name: str, body: bytes, generation: int) -> Written:
        blob = self.bucket.blob(name)
        self.dates.clear()
        try:
            blob.upload_from_string(
                body,
                content_type="application/json",
                if_generation_match=generation,
                timeout=self.timeout,
                retry=self.retry,
            )
        except google_errors.PreconditionFailed:
            return Written(None, self.dates.stamp())
        except google_errors.NotFound as exc:  # an upload's 404 is the bucket's
            raise self._no_bucket(exc) from exc
        except _FAILURES as exc:
            code = getattr(exc, "code", None)
            if isinstance(code, int) and code < 500 and code not in (408, 429):
                raise self._failed(f"PUT {name}", exc) from exc
            # A timeout, a reset or a 5xx: the upload may have taken effect.
            raise UnsureWrite(f"GCS PUT {name} failed: {exc}", self.where) from exc
        self._bucket_seen = True
        # ``updated`` is the server's time at which this write took effect.
        return Written(str(blob.generation), self.dates.stamp(blob.updated))

    def names(self, prefix: str, start_after: str | None = None) -> Iterator[str]:
        try:
            blobs = self.client.list_blobs(
                self.bucket,
                prefix=prefix,
                start_offset=start_after,
                fields="items(name),nextPageToken",
                timeout=self.timeout,
                retry=self.retry,
            )
            for blob in blobs:
                if blob.name != start_after:
                    yield str(blob.name)
        except _FAILURES as exc:
            raise self._failed(f"LIST {prefix}", exc) from exc

    def delete_if(self, name: str, version: str) -> bool:
        try:
            self.bucket.blob(name).delete(
                if_generation_match=int(version), timeout=self.timeout, retry=self.retry
            )
        except (google_errors.NotFound, google_errors.PreconditionFailed):
            return False
        except _FAILURES as exc:
            raise self._failed(f"DELETE {name}", exc) from exc
        return True

    def delete(self, name: str) -> None:
        try:
            self.bucket.blob(name).delete(timeout=self.timeout, retry=self.retry)
        except google_errors.NotFound:
            return
        except _FAILURES as exc:
            raise self._failed(f"DELETE {name}", exc) from exc

    def close(self) -> None:
        self.client.close()
