"""Locks in an S3 bucket (AWS or an S3-compatible store with conditional writes).

URL
    ``s3://bucket/prefix`` (credentials from boto3's usual chain: environment, profile,
    instance role) or ``s3://ACCESS_KEY:SECRET_KEY@bucket/prefix`` (percent-encode ``/`` and
    ``+`` in the secret; it is masked in every output). Example for a local server:
    ``s3://key:secret@locks/prod?endpoint_url=http://127.0.0.1:9000&region=us-east-1``.

Options
    ``endpoint_url`` (URL): an S3-compatible endpoint instead of AWS.
    ``region`` (name): the bucket's region (default: boto3's configuration).
    ``addressing_style`` (``auto``/``path``/``virtual``, default ``auto``).
    ``timeout`` (seconds, default 10): connect and read timeout of each request.
    ``max_attempts`` (int, default 4): attempts per request, boto3's retries included.
    ``gc_after`` (seconds, default 86400): ``reap()`` deletes lock objects free that long.
    ``ttl`` (seconds, default 60): the ttl of a lock given none, renewed every ``ttl / 3``.
    ``access_key``, ``secret_key``: the credentials, instead of ``KEY:SECRET@``.
    ``S3Backend(..., clock=...)`` takes the local clock that measures time between responses.

Guarantees
    Mutual exclusion rests on ``If-None-Match: *`` (create) and ``If-Match: <ETag>`` (swap)
    on PutObject, which AWS honours since 2024-11; the janitor's collect uses
    ``If-Match`` on DeleteObject (AWS: 2025-09). Every body carries a fresh nonce, so ETags
    (content hashes) never repeat. A 412, or a 404 on ``If-Match`` of a missing key, means
    "not ours"; a 409 ConditionalRequestConflict is retried.
    crash: a dead holder's lease expires ``ttl`` after its last renewal (by S3's clock); a
    lock given no ``ttl`` gets the URL's (60 s by default), renewed while held.
    clock skew: expiry is judged by the ``Date`` of S3's responses, never the caller's clock.
    partition: a holder cut off from S3 cannot renew; its lease expires, and its late
    writes fail their condition. Use the lease's fence to guard the resource.
    durability: lock objects and history are ordinary objects (S3's durability).

Install
    ``pip install 'celery-dlock[s3]'`` (boto3).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal
from urllib.parse import unquote, urlsplit

import boto3
import botocore.handlers
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from celery_dlock.backends import mask_url
from celery_dlock.backends.base import MonotonicClock
from celery_dlock.backends.common import url_options
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

if TYPE_CHECKING:
    from types_boto3_s3 import S3Client

__all__ = ["S3Backend"]

#: Retries of a write answered 409 ConditionalRequestConflict (a concurrent conditional
#: write to the same key was in flight; AWS says to retry).
_CONFLICT_RETRIES = 5
AddressingStyle = Literal["auto", "path", "virtual"]
_STYLES: tuple[AddressingStyle, ...] = ("auto", "path", "virtual")


def _addressing_style(text: str) -> AddressingStyle:
    for style in _STYLES:
        if text == style:
            return style
    raise ValueError(f"one of {', '.join(_STYLES)}")


class S3Backend(ObjectStoreBackend):
    """Locks as objects in an S3 bucket, written only with conditional requests."""

    name = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str = "auto",
        timeout: float = 10.0,
        max_attempts: int = 4,
        access_key: str | None = None,
        secret_key: str | None = None,
        gc_after: float = 86400.0,
        ttl: float = DEFAULT_TTL,
        clock: MonotonicClock | None = None,
    ) -> None:
        super().__init__(bucket, prefix, gc_after=gc_after, clock=clock)
        # A lease lives by its ttl alone here: a Lock without one gets this, renewed.
        self.default_ttl = float(checked_option("s3", "ttl", ttl, least=0, above=True))
        self.endpoint_url = endpoint_url
        self.region = region
        self.addressing_style = _addressing_style(addressing_style)
        self.timeout = float(checked_option("s3", "timeout", timeout, least=0, above=True))
        self.max_attempts = int(
            checked_option("s3", "max_attempts", max_attempts, least=1, above=False)
        )
        self._access_key = access_key
        self._secret_key = secret_key
        self.url = f"s3://{bucket}/{self.prefix}"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Backend:
        parts = urlsplit(url)
        userinfo, _, bucket = parts.netloc.rpartition("@")
        if ":" in parts.netloc and "@" not in parts.netloc and "@" in url.partition("://")[2]:
            # A secret key cut by its '/' (AWS's hold some), or a '?' or '#': it was
            # refused as naming no bucket.
            raise ConfigurationError(
                f"S3 backend URL {mask_url(url)!r} holds an '@' after its bucket: "
                "percent-encode a '/', '?' or '#' in its secret key (%2F, %3F, %23)"
            )
        if not bucket or ":" in bucket:
            raise ConfigurationError(
                f"S3 backend URL {mask_url(url)!r} names no bucket: use s3://bucket/prefix"
            )
        if userinfo:
            access_key, has_secret, secret_key = userinfo.partition(":")
            if not has_secret:
                raise ConfigurationError(
                    "an S3 URL with credentials has KEY:SECRET@ before the bucket"
                )
            options.setdefault("access_key", unquote(access_key))
            options.setdefault("secret_key", unquote(secret_key))
        clock = options.pop("clock", None)
        known: dict[str, Callable[[str], Any]] = {
            "endpoint_url": str,
            "region": str,
            "addressing_style": _addressing_style,
            "timeout": float,
            "max_attempts": int,
            "gc_after": float,
            "ttl": float,
            "access_key": str,
            "secret_key": str,
        }
        backend = cls(
            bucket,
            unquote(parts.path),
            clock=clock,
            **url_options("s3", parts.query, known, options),
        )
        backend.url = mask_url(url)
        return backend

    def _endpoint(self) -> str:
        return self.endpoint_url or f"aws:{self.region or ''}"

    def _open_store(self) -> ObjectStore:
        config = Config(
            connect_timeout=self.timeout,
            read_timeout=self.timeout,
            retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
            s3={"addressing_style": self.addressing_style},
            # Plain Content-MD5-free requests: S3-compatible stores differ on the newer
            # default checksums, and a lock body is a few hundred bytes.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session(
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._secret_key,
            region_name=self.region,
        )
        try:
            client: S3Client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
        except (BotoCoreError, ValueError) as exc:
            raise ConfigurationError(f"cannot make an S3 client for {self.url}: {exc}") from exc
        # boto3 sends every PutObject with "Expect: 100-continue" and waits up to 1 s for
        # the go-ahead; under contention SeaweedFS answers late (measured: 1 s stalls in
        # 16-way races). A lock body is a few hundred bytes: send it at once.
        client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)
        return S3Store(client, self.bucket, self.url)


class S3Store(ObjectStore):
    """One S3 bucket through boto3. Driver errors become :class:`BackendError` here only."""

    retry_pause: ClassVar[float] = 0.05

    def __init__(self, client: S3Client, bucket: str, where: str) -> None:
        self.client = client
        self.bucket = bucket
        self.where = where

    def _failed(self, what: str, exc: Exception) -> BackendError:
        hint = ""
        if isinstance(exc, ClientError) and _status(exc) == 404 and not _missing(exc):
            hint = " (no S3 NoSuchKey answer: check the bucket, endpoint_url, addressing_style)"
        return BackendError(f"S3 {what} failed: {exc}{hint}", self.where)

    def read(self, name: str) -> Found:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=name)
            body = reply["Body"].read()
        except ClientError as exc:
            if _missing(exc):
                return Found(None, None, _stamp(exc.response))
            raise self._failed(f"GET {name}", exc) from exc
        except BotoCoreError as exc:
            raise self._failed(f"GET {name}", exc) from exc
        return Found(body, reply["ETag"], _stamp(reply))

    def create(self, name: str, body: bytes) -> Written:
        return self._put(name, body, {"IfNoneMatch": "*"})

    def swap(self, name: str, body: bytes, version: str) -> Written:
        return self._put(name, body, {"IfMatch": version})

    def _put(self, name: str, body: bytes, condition: dict[str, str]) -> Written:
        for attempt in range(_CONFLICT_RETRIES + 1):
            try:
                reply = self.client.put_object(
                    Bucket=self.bucket,
                    Key=name,
                    Body=body,
                    ContentType="application/json",
                    **condition,  # type: ignore[arg-type]  # IfMatch or IfNoneMatch, both str
                )
            except ClientError as exc:
                status = _status(exc)
                # 412: the condition failed. 404: If-Match on a missing key (AWS, moto).
                if status == 412 or _missing(exc):
                    return Written(None, _stamp(exc.response))
                if status == 409 and attempt < _CONFLICT_RETRIES:
                    time.sleep(self.retry_pause * random.uniform(1, 2) * (attempt + 1))
                    continue
                if status is not None and status < 500 and status not in (408, 409, 429):
                    raise self._failed(f"PUT {name}", exc) from exc
                raise UnsureWrite(f"S3 PUT {name} failed: {exc}", self.where) from exc
            except BotoCoreError as exc:
                raise UnsureWrite(f"S3 PUT {name} failed: {exc}", self.where) from exc
            return Written(reply["ETag"], _stamp(reply))
        raise AssertionError("unreachable")  # pragma: no cover

    def names(self, prefix: str, start_after: str | None = None) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            if start_after is None:
                pages = paginator.paginate(Bucket=self.bucket, Prefix=prefix)
            else:
                pages = paginator.paginate(
                    Bucket=self.bucket, Prefix=prefix, StartAfter=start_after
                )
            for page in pages:
                for item in page.get("Contents", []):
                    yield item["Key"]
        except (ClientError, BotoCoreError) as exc:
            raise self._failed(f"LIST {prefix}", exc) from exc

    def delete_if(self, name: str, version: str) -> bool:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=name, IfMatch=version)
        except ClientError as exc:
            if _status(exc) == 412 or _missing(exc):
                return False
            raise self._failed(f"DELETE {name}", exc) from exc
        except BotoCoreError as exc:
            raise self._failed(f"DELETE {name}", exc) from exc
        return True

    def delete(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=name)
        except (ClientError, BotoCoreError) as exc:
            raise self._failed(f"DELETE {name}", exc) from exc

    def close(self) -> None:
        self.client.close()


def _status(exc: ClientError) -> int | None:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None if status is None else int(status)


def _missing(exc: ClientError) -> bool:
    """A 404 for the key (``NoSuchKey``), not for the bucket, nor a bare 404 from something
    that is not S3 (a wrong endpoint or addressing style): neither may look like a free
    key, or like a key held by someone else."""
    return _status(exc) == 404 and exc.response.get("Error", {}).get("Code") == "NoSuchKey"


def _stamp(reply: Any) -> Stamp:
    """The server's clock from a response (or an error's response) of boto3."""
    headers = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    date = headers.get("date")
    if not date:
        return Stamp(None)
    try:
        return Stamp(parsedate_to_datetime(date).timestamp())
    except (TypeError, ValueError):
        return Stamp(None)
