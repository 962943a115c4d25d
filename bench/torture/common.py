"""Small helpers of the Celery soaks (``soak.py``, ``dedupesoak.py``) and their apps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["append_jsonl", "soak_config", "stop_worker"]

#: This process's open logs, by pid (a forked child opens its own) and path.
_open: dict[tuple[int, Path], int] = {}


def append_jsonl(path: Path, entry: dict[str, Any]) -> None:
    """``entry`` as one line of the JSON-lines file ``path``: one ``write`` of a file opened
    with ``O_APPEND``, so a line is whole, or absent after a SIGKILL."""
    opened = (os.getpid(), path)
    if opened not in _open:
        _open[opened] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(_open[opened], (json.dumps(entry, separators=(",", ":")) + "\n").encode())


def stop_worker(worker: subprocess.Popen[bytes] | None) -> None:
    """A warm shutdown of a Celery worker (SIGTERM), SIGKILL after 60 s."""
    if worker is None or worker.poll() is not None:
        return
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(60)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def soak_config(broker: str, store: str, namespace: str, visibility: float) -> dict[str, Any]:
    """A soak app's Celery settings: ``acks_late``, one message at a time per child, the
    broker's unacked messages restored within seconds (redeliveries inside the run)."""
    return {
        "broker_url": broker,
        "broker_transport_options": {
            "visibility_timeout": visibility,
            # kombu 5.7 sweeps for unacked messages every interval x throttle seconds (100 s
            # by default): every second here, so that redeliveries happen within the run.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        "broker_connection_retry_on_startup": True,
        "task_acks_late": True,
        "task_ignore_result": True,
        "worker_prefetch_multiplier": 1,
        "dlock_backend": store,
        "dlock_namespace": namespace,
    }
