"""The S3 and GCS stores tried as a demanding user would, on the real emulator servers: URL
mistakes, a bucket that does not exist, an endpoint that is not S3, a prefix as long as
object names allow, and the history's intervals of a key seen from several processes'
clocks."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote

import pytest

from celery_dlock import BackendError, ConfigurationError, Holder, Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.objectstore import ObjectStoreBackend
from celery_dlock.backends.objectstore.layout import OBJECT_NAME_LIMIT, PREFIX_LIMIT
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    BUCKET,
    Server,
    any_object_server,
    object_server,
    unique_prefix,
)

S3 = "s3://k:s@bucket/p?endpoint_url=http://127.0.0.1:9&region=us-east-1"
GS = "gs://bucket/p?endpoint=http://127.0.0.1:9&anonymous=1"


@pytest.mark.parametrize(
    ("url", "option"),
    [
        (f"{S3}&max_attempts=0", "max_attempts"),
        (f"{S3}&timeout=0", "timeout"),
        (f"{S3}&timeout=nan", "timeout"),
        (f"{S3}&gc_after=-1", "gc_after"),
        (f"{S3}&gc_after=nan", "gc_after"),
        (f"{GS}&timeout=-1", "timeout"),
        (f"{GS}&timeout=inf", "timeout"),
        (f"{GS}&gc_after=nan", "gc_after"),
        ("gs://bucket/p?endpoint=127.0.0.1:4443&anonymous=1", "endpoint"),
    ],
)
def test_a_bad_option_value_is_refused_when_the_url_is_read_naming_the_option(
    url: str, option: str
) -> None:
    # Before: accepted, then at the first request a driver's error (botocore's
    # InvalidMaxRetryAttemptsError, urllib3's ValueError, "No connection adapters").
    with pytest.raises(ConfigurationError, match=f"option '{option}'"):
        backend_from_url(url)


def test_a_missing_bucket_is_an_error_naming_it_not_a_free_key(
    object_server: Server,  # noqa: F811
) -> None:
    # GCS answers 404 alike for a missing object and a missing bucket: get() said "free".
    url = object_server.url(unique_prefix()).replace(f"{BUCKET}/", "dlock-no-such-bucket/")
    backend = backend_from_url(url)
    with pytest.raises(BackendError, match="dlock-no-such-bucket"):
        backend.get("job:nowhere")
    with pytest.raises(BackendError, match="dlock-no-such-bucket"):
        backend.try_acquire("job:nowhere", Holder.current(), None)
    backend.close()


def test_a_prefix_past_the_object_name_limit_is_refused() -> None:
    prefix = "p" * (PREFIX_LIMIT + 1)
    with pytest.raises(ConfigurationError, match=f"over the limit of {PREFIX_LIMIT}"):
        backend_from_url(f"{S3.replace('/p?', f'/{prefix}?')}")
    with pytest.raises(ConfigurationError, match="control character"):
        backend_from_url(GS.replace("/p?", "/a%0Ab?"))


def test_the_longest_prefix_key_and_task_name_keep_every_record(
    any_object_server: Server,  # noqa: F811
) -> None:
    # SeaweedFS refuses names over 1024 bytes, as S3 and GCS do. Before, a 700-byte prefix
    # was accepted; the success/ object of a long key failed, and then every release of
    # that key (which must first copy the previous record) was refused.
    own = unique_prefix() + "-"
    prefix = own + "é" * ((PREFIX_LIMIT - len(own)) // 2)
    assert PREFIX_LIMIT - 1 <= len(prefix.encode()) <= PREFIX_LIMIT
    backend = backend_from_url(any_object_server.url(quote(prefix)))
    assert isinstance(backend, ObjectStoreBackend)
    key, task_name = "ü" * 512, "tasks." + "%" * 66  # both encode to the longest names
    records = []
    for n in range(2):
        lease = backend.try_acquire(key, Holder.current(task_name=task_name), None)
        assert lease is not None
        record = backend.release(lease, Outcome.SUCCEEDED, result=n)
        assert record is not None
        records.append(record)
    assert backend.history(key=key, limit=None) == records[::-1]
    names = [*backend.store().names(backend.layout.success)]
    assert len(names) == 1  # the first success is kept; the second release keeps none
    assert max(len(name.encode()) for name in names) <= OBJECT_NAME_LIMIT
    assert backend.last_success(key, task_name) == records[0]
    backend.close()


def _fresh(url: str) -> ObjectStoreBackend:
    """A backend whose server clock knows only what its own responses tell it, as in a
    process that just started (the clock is shared per process and local clock)."""

    def local_clock() -> float:  # a new function each time: a server clock of its own
        return time.monotonic()

    backend = backend_from_url(url, clock=local_clock)
    assert isinstance(backend, ObjectStoreBackend)
    return backend


def test_a_lease_never_starts_before_the_one_it_follows_ended(
    object_server: Server,  # noqa: F811
) -> None:
    # A Date header has whole seconds: a process that has seen one response puts the
    # server's time anywhere in that second, and used the lowest. The next holder's
    # acquired_at then came up to a second before its predecessor's released_at.
    url = object_server.url(unique_prefix())
    first = _fresh(url)
    first.objects.calibrate()
    while not 0.4 < time.time() % 1 < 0.6:  # late in a second: a fresh window starts lower
        time.sleep(0.01)
    lease = first.try_acquire("job:order", Holder.current(), None)
    assert lease is not None
    ended = first.release(lease, Outcome.SUCCEEDED)
    assert ended is not None
    second = _fresh(url)
    follower = second.try_acquire("job:order", Holder.current(), None)
    assert follower is not None and follower.fence == lease.fence + 1
    assert follower.acquired_at >= ended.released_at
    assert second.release(follower, Outcome.SUCCEEDED) is not None
    history = sorted(first.history(key="job:order"), key=lambda record: record.lease.fence)
    assert [record.lease.fence for record in history] == [lease.fence, follower.fence]
    assert history[0].released_at <= history[1].lease.acquired_at
    first.close()
    second.close()


class _NotS3(BaseHTTPRequestHandler):
    """A web server that is not S3 (a wrong endpoint, a proxy's path): 404 to everything,
    with no S3 error code."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(404)
        self.send_header("Content-Length", "9")
        self.end_headers()
        self.wfile.write(b"not found")

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def test_an_s3_endpoint_that_is_not_s3_is_an_error_not_a_free_or_held_key() -> None:
    # Before: a bare 404 was read as "no such key": get() said free, and every create
    # "failed its condition", so try_acquire said the key was held, for ever.
    with ThreadingHTTPServer(("127.0.0.1", 0), _NotS3) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        backend = backend_from_url(
            f"s3://k:s@bucket/p?endpoint_url={endpoint}&region=us-east-1&max_attempts=1"
        )
        try:
            with pytest.raises(BackendError, match="no S3 NoSuchKey answer"):
                backend.get("job:where")
            with pytest.raises(BackendError, match="no S3 NoSuchKey answer"):
                backend.try_acquire("job:where", Holder.current(), None)
        finally:
            backend.close()
            server.shutdown()
            thread.join()
