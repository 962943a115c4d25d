"""The payments example as a newcomer meets it: the demo command, and the fenced ledger."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from dlock_support import unavailable

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_the_demo_charges_every_order_exactly_once(tmp_path: Path) -> None:
    pytest.importorskip("celery")
    result = subprocess.run(
        [sys.executable, "-m", "worker_example.demo", "--data", str(tmp_path / "demo")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = result.stdout
    assert result.returncode == 0, output + result.stderr
    assert "every order charged exactly once: YES" in output
    assert "charged 1x  ok" in output and "WRONG" not in output
    assert "released as disconnected" in output
    assert "worker_example.gateway.CardDeclined: card ending 0002 declined" in output
    assert "duplicates replayed the stored result" in output
    assert "SIGKILLed worker child" in output  # progress lines while it runs


def _ledgers(tmp_path: Path) -> list[str]:
    urls = [f"sqlite:///{tmp_path}/ledger.sqlite"]
    try:
        import psycopg

        schema = f"ledger_{tmp_path.name[-8:].replace('-', '_')}"
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as c:
            c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            c.execute(f"CREATE SCHEMA {schema}")
        urls.append(f"postgresql://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}")
    except ImportError:
        unavailable("psycopg is not installed: pip install 'celery-dlock[postgres]'")
    except Exception as exc:
        unavailable(f"PostgreSQL is not reachable on 127.0.0.1:5432 ({exc})")
    return urls


def test_the_ledger_refuses_a_write_with_a_stale_fence(tmp_path: Path) -> None:
    from worker_example.ledger import Ledger, StaleFenceError

    for url in _ledgers(tmp_path):
        ledger = Ledger(url)
        ledger.create()
        ledger.add_orders([(1, "ada", Decimal("12.50"), "4242 4242 4242 4242")])
        ledger.charge("job:order:1", 7, order_id=1, amount=Decimal("12.50"), task_id="a", pid=1)
        # A holder whose lease (fence 5) was lost while it was paused wakes up and writes:
        with pytest.raises(StaleFenceError) as info:
            ledger.charge("job:order:1", 5, order_id=1, amount=Decimal("12.50"), task_id="b", pid=2)
        assert info.value.newest == 7
        with pytest.raises(StaleFenceError):  # the same fence twice is stale too
            ledger.charge("job:order:1", 7, order_id=1, amount=Decimal("12.50"), task_id="c", pid=3)
        assert ledger.charges_per_order() == {1: 1}
        ledger.refund("job:order:1", 8, 1, Decimal("12.50"))  # the newer lease writes
        with pytest.raises(StaleFenceError):
            ledger.refund("job:order:1", 6, 1, Decimal("12.50"))
