"""moto's S3 server, one request at a time: ``python moto_atomic.py HOST PORT``.

moto checks a PutObject precondition (``If-Match``, ``If-None-Match: *``) and then writes,
with nothing held between the two. Under CPU load two conditional writes on the same
version can both win (measured 2026-11-21: 2 double winners in 600 rounds of 12 processes
racing one ``If-Match`` each, with two CPU burners beside; none without the burners). Real
S3 makes a conditional write atomic, and the lock tests prove mutual exclusion on that
promise, so this server handles one request at a time. moto's own work holds the GIL, so
serialising its requests costs little.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple


def serialised(app: Callable[..., Iterable[bytes]]) -> Callable[..., list[bytes]]:
    """``app`` as a WSGI application that runs one request, response body included, at a
    time."""
    mutex = threading.Lock()

    def handle(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with mutex:
            return list(app(environ, start_response))

    return handle


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    os.environ.setdefault("MOTO_PORT", str(port))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, serialised(app), threaded=True)


if __name__ == "__main__":
    main()
