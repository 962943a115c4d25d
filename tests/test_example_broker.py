"""The demo's embedded broker (``worker_example.broker``): a message file is never seen
empty or cut short. kombu's own filesystem transport allows it (2-5 torn reads in this
test's 300 messages, in three runs): a consumer that read one died of a JSONDecodeError in
CI, and the demo hung."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

kombu = pytest.importorskip("kombu")

from worker_example.broker import SCHEME  # noqa: E402


def torn_reads_while_putting(scheme: str, folder: Path, messages: int = 300) -> int:
    """Put ``messages`` of 256 KiB through a real kombu connection while a reader reads every
    message file it lists; how many it found empty or cut short (not JSON)."""
    # The exchange's bindings too (kombu writes them to ``control/`` of the working
    # directory by default: a run from the checkout left ``control/q.exchange`` in it).
    control = folder.parent / f"{folder.name}-control"
    control.mkdir()
    options = {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(control),
    }
    stop, torn = threading.Event(), [0]

    def read() -> None:
        while not stop.is_set():
            for name in os.listdir(folder):
                if name.endswith(".msg"):
                    try:
                        json.loads((folder / name).read_bytes())
                    except FileNotFoundError:
                        pass
                    except ValueError:
                        torn[0] += 1

    reader = threading.Thread(target=read)
    reader.start()
    with kombu.Connection(f"{scheme}://", transport_options=options) as connection:
        queue = connection.SimpleQueue("q")
        for n in range(messages):
            queue.put({"n": n, "pad": "x" * 256 * 1024})
        assert len(os.listdir(folder)) >= messages
        queue.close()
    stop.set()
    reader.join()
    return torn[0]


def test_a_message_file_is_never_seen_empty_or_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    (tmp_path / "queue").mkdir()
    assert torn_reads_while_putting(SCHEME, tmp_path / "queue") == 0
    assert list(here.iterdir()) == []  # nothing written where the tests run
