"""The payments example as a newcomer meets it: the demo command, and the fenced ledger."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from tests.support import unavailable

ROOT = Path(__file__).parent.parent


def run_demo(command: list[str]) -> subprocess.CompletedProcess[str]:
    """The demo, in a session of its own: past the timeout its worker and beat are killed
    with it (a demo killed alone left its beat running for good)."""
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        message = f"the demo ran past 240 s:\n{stdout[-4000:]}{stderr[-2000:]}"
        raise AssertionError(message) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_the_demo_charges_every_order_exactly_once(tmp_path: Path) -> None:
    pytest.importorskip("celery")
    result = run_demo(
        [sys.executable, "-m", "worker_example.demo", "--data", str(tmp_path / "demo")]
    )
    output = result.stdout
    assert result.returncode == 0, output + result.stderr
    assert "every order charged exactly once: YES" in output
    assert "charged 1x  ok" in output and "WRONG" not in output
    assert "released as disconnected" in output
    assert "worker_example.gateway.CardDeclined: card ending 0002 declined" in output
    assert "duplicates replayed the stored result" in output
    assert "SIGKILLed worker child" in output  # progress lines while it runs
    runs = re.search(r"200 webhook submissions for customer-1 became (\d+) runs?", output)
    assert runs is not None and 1 <= int(runs.group(1)) <= 2
    assert "the webhook burst ran at most twice: YES" in output
    assert "20 opposite transfers between accounts A and B, never two at once: YES" in output


@pytest.mark.slow
def test_the_demo_on_postgres_keeps_each_success_in_the_charges_transaction(
    tmp_path: Path,
) -> None:
    pytest.importorskip("celery")
    url = "postgresql://postgres@127.0.0.1:5432/test"
    _ledgers(tmp_path)  # Postgres is there (or a visible skip)
    demo = [sys.executable, "-m", "worker_example.demo", "--data", str(tmp_path / "demo")]
    result = run_demo([*demo, "--postgres", url])
    output = result.stdout
    schema = re.search(r"in schema (demo_[0-9a-f]+)", output)
    if schema is not None:
        import psycopg

        with psycopg.connect(url, autocommit=True) as connection:
            for name in (schema[1], f"{schema[1]}_locks"):
                connection.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
    assert result.returncode == 0, output + result.stderr
    assert "ledger's own transaction (record_success): YES" in output
    assert "every order charged exactly once: YES" in output
    assert "order 6: 1x" in output  # the gateway moved the killed child's charge once
    assert schema is not None
    assert f"DROP SCHEMA {schema[1]}, {schema[1]}_locks CASCADE" in output  # said what it left


def test_the_gateway_refuses_a_second_charge_with_the_same_idempotency_key(
    tmp_path: Path,
) -> None:
    """Both defences defeated (once forgot the first success, and the second run holds a
    lease of its own): the charge's body runs twice, and the gateway itself moves the
    money once, answering the second request with the first one's reference."""
    pytest.importorskip("celery")
    script = (
        "import json, sys\n"
        "from decimal import Decimal\n"
        "from worker_example import gateway, tasks\n"
        "tasks.ledger.create()\n"
        "tasks.ledger.add_orders([(1, 'ada', Decimal('12.50'), gateway.APPROVED)])\n"
        "first = tasks.charge.apply((1,)).get()\n"
        "tasks.charge.once = False  # once defeated: as if it had forgotten the success\n"
        "second = tasks.charge.apply((1,)).get()\n"
        "print(json.dumps([first, second, gateway.charges(tasks.DATA)]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "DLOCK_EXAMPLE_DATA": str(tmp_path / "data")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first, second, moved = json.loads(result.stdout.strip().splitlines()[-1])
    assert second["charge"] != first["charge"]  # the body did run twice...
    assert second["reference"] == first["reference"]  # ...the gateway answered the first
    assert moved == [{"order": 1, "amount": "12.50", "reference": first["reference"]}]


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
