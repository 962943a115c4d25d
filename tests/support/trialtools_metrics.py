"""Running metrics code in a process of its own, for the metrics trial.

The metrics of a process are made once (``metrics.enable`` keeps its first registry), and
prometheus_client picks its multiprocess mode at import, from the environment: a test that
turns them on in the test process would change what every later test sees. Each snippet
runs in a fresh interpreter instead, with the checkout first on its path, and prints one
JSON object as its last line of output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


def run_snippet(code: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` (dedented) with ``args`` in ``sys.argv[1:]``; its last line of standard
    output, parsed as JSON. A snippet that fails fails the test, with its stderr."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        environment.pop(name, None)
    environment.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise AssertionError(f"the snippet failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
