"""The torture harness's fenced ledger (``bench/torture/ledger.py``): a holder that lost its
lease and wakes up to write after its successor *read* is refused, though the successor has
not written yet. A fence checked at the write alone accepted it, and the two updates
overwrote each other: the first million-acquisition file run lost one update so."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.torture.ledger import Ledger, open_ledger
from tests.support.services import POSTGRES_URL


@pytest.fixture(params=["file", "postgres"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "file":
        made = open_ledger(f"file://{tmp_path}/ledger")
    else:
        made = open_ledger(f"{POSTGRES_URL}#ledger_{uuid.uuid4().hex[:12]}")
    made.create(["k"])
    yield made
    made.drop()
    made.close()


def test_a_stale_holder_writing_after_its_successor_read_is_refused(ledger: Ledger) -> None:
    stale = ledger.read("k", 1)  # then paused past its ttl; fence 2 takes the key
    fresh = ledger.read("k", 2)
    assert ledger.write("k", 1, stale + 1) is False  # before fence 2 wrote anything
    assert ledger.write("k", 2, fresh + 1) is True
    assert ledger.state() == {"k": (1, 2)}
    assert ledger.journal() == {"k": [(2, 1)]}


def test_writes_in_fence_order_after_their_own_reads_are_accepted(ledger: Ledger) -> None:
    for fence in (1, 2, 3):
        assert ledger.write("k", fence, ledger.read("k", fence) + 1) is True
    assert ledger.write("k", 3, 9) is False  # the same fence again
    assert ledger.read("k") == 3  # a read without a fence registers nothing
    assert ledger.write("k", 4, 4) is True
    assert ledger.journal() == {"k": [(1, 1), (2, 2), (3, 3), (4, 4)]}
