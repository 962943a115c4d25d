"""One process counts in one registry: ``metrics.enable(other)`` after the metrics were made
in a registry is refused with an error naming both (it used to keep the first in silence,
so a second registry read zero for ever), while ``enable()`` and ``enable(the same)`` go on
counting in the first. Run in a fresh interpreter: the metrics are made once per process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("prometheus_client")

SCRIPT = textwrap.dedent(
    """
    import json
    from prometheus_client import CollectorRegistry
    from celery_dlock import ConfigurationError, Holder, Lock, metrics
    from celery_dlock.backends.memory import MemoryBackend

    first, second = CollectorRegistry(), CollectorRegistry()
    metrics.enable(first)
    try:
        metrics.enable(second)
        refused = None
    except ConfigurationError as exc:
        refused = str(exc)
    metrics.disable()
    metrics.enable()  # dlock_metrics = True after the app's own enable(first)
    metrics.enable(first)
    with Lock(MemoryBackend(), "job:one", holder=Holder.current(task_name="t.one")):
        pass
    labels = {"task": "t.one", "outcome": "succeeded"}
    print(json.dumps({
        "refused": refused,
        "first": first.get_sample_value("dlock_releases_total", labels),
        "second": second.get_sample_value("dlock_releases_total", labels),
    }))
    """
)


def test_a_second_registry_is_refused_and_the_first_keeps_counting() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["refused"] is not None
    assert "a process counts in one registry" in out["refused"]
    assert out["first"] == 1.0
    assert out["second"] is None
