"""``timeline -o FILE``: the picture of who held which key when, run for real against real
stores and read back as XML: one row per key, one bar per lease with its fence, outcome and
holder, live leases to now, filters by key prefix and time."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from celery_dlock import Lock
from celery_dlock.cli.timeline import COLOURS
from celery_dlock.records import Holder, Outcome
from tests.cli.clitools import CliStore, run_cli

SVG = "{http://www.w3.org/2000/svg}"


def bars(path: Path) -> list[ET.Element]:
    root = ET.parse(path).getroot()
    if root.tag != f"{SVG}svg":  # an HTML page: the svg inside it
        found = root.find(f".//{SVG}svg")
        assert found is not None
        root = found
    return [rect for rect in root.iter(f"{SVG}rect") if rect.get("class") == "lease"]


def test_every_lease_is_a_bar_in_its_keys_row_coloured_by_outcome(
    store: CliStore, tmp_path: Path
) -> None:
    backend = store.backend
    ended = []
    for key, outcome in [
        ("job:order:1", Outcome.SUCCEEDED),
        ("job:order:1", Outcome.FAILED),
        ("job:order:2", Outcome.REVOKED),
    ]:
        lease = backend.try_acquire(key, Holder.current(task_name="t.charge"), None)
        assert lease is not None
        time.sleep(0.2)
        backend.release(lease, outcome, "ValueError" if outcome is Outcome.FAILED else None)
        ended.append((lease, outcome))
    live = Lock(backend, "job:order:3")
    held = live.acquire()
    other = backend.try_acquire("other:x", Holder.current(), None)  # outside the namespace
    assert other is not None

    out = tmp_path / "timeline.svg"
    result = run_cli("--backend", store.url, "timeline", "--since", "15s", "-o", str(out))

    assert result.returncode == 0, result.stderr
    assert "4 leases on 3 keys" in result.stdout
    found = {rect.get("data-token"): rect for rect in bars(out)}
    assert set(found) == {lease.token for lease, _ in ended} | {held.token}
    for lease, outcome in ended:
        rect = found[lease.token]
        assert rect.get("data-key") == lease.key and rect.get("data-fence") == str(lease.fence)
        assert rect.get("data-outcome") == outcome.value
        assert rect.get("fill") == COLOURS[outcome.value]
        title = rect.findtext(f"{SVG}title") or ""
        assert lease.holder.describe() in title and f"fence {lease.fence}" in title
    assert "(ValueError)" in (found[ended[1][0].token].findtext(f"{SVG}title") or "")
    live_bar = found[held.token]
    assert live_bar.get("data-outcome") == "held" and live_bar.get("fill") == "url(#held)"
    # Rows by key: the two leases of order 1 share a row, in time order, left to right.
    rows = {rect.get("data-key"): rect.get("y") for rect in found.values()}
    assert len(set(rows.values())) == 3
    first, second = (found[lease.token] for lease, _ in ended[:2])
    assert first.get("y") == second.get("y")
    assert float(first.get("x") or 0) < float(second.get("x") or 0)
    live.release()
    backend.release(other, Outcome.SUCCEEDED)


def test_key_prefix_since_and_html(file_store: CliStore, tmp_path: Path) -> None:
    backend = file_store.backend
    for key in ("job:a:1", "job:b:1"):
        lease = backend.try_acquire(key, Holder.current(), None)
        assert lease is not None
        backend.release(lease, Outcome.SUCCEEDED)
    page = tmp_path / "t.html"
    result = run_cli("--backend", file_store.url, "timeline", "--key", "job:a:", "-o", str(page))
    assert result.returncode == 0, result.stderr
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert [rect.get("data-key") for rect in bars(page)] == ["job:a:1"]
    time.sleep(1.1)
    later = tmp_path / "later.svg"
    result = run_cli("--backend", file_store.url, "timeline", "--since", "1s", "-o", str(later))
    assert result.returncode == 0, result.stderr
    assert bars(later) == []  # released before the window


def test_an_output_that_is_not_svg_or_html_is_refused(file_store: CliStore, tmp_path: Path) -> None:
    result = run_cli("--backend", file_store.url, "timeline", "-o", str(tmp_path / "t.png"))
    assert result.returncode == 2
    assert ".svg" in result.stderr and not (tmp_path / "t.png").exists()


def test_json_has_the_records_and_the_held_leases_of_the_picture(
    store: CliStore, tmp_path: Path
) -> None:
    backend = store.backend
    done = backend.try_acquire("job:order:1", Holder.current(task_name="t.charge"), None)
    assert done is not None
    backend.release(done, Outcome.FAILED, "ValueError", "boom")
    held = backend.try_acquire("job:order:2", Holder.current(task_name="t.charge"), 600)
    other = backend.try_acquire("cron:x", Holder.current(task_name="t.other"), 600)
    assert held is not None and other is not None
    output = tmp_path / "t.svg"
    result = run_cli("--backend", store.url, "timeline", "--json", "-o", str(output))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # only the JSON on stdout, though a file was written too
    assert data["backend"] == store.url and data["prefix"] == "job:"
    assert data["output"] == str(output) and len(bars(output)) == 2
    [record] = data["records"]  # the shape of `history --json`
    assert (record["key"], record["outcome"], record["fence"]) == (
        "job:order:1",
        "failed",
        done.fence,
    )
    assert record["lease"]["token"] == done.token
    [lease] = data["leases"]  # the shape of `leases --json`
    assert (lease["key"], lease["token"], lease["fence"]) == (held.key, held.token, held.fence)
    assert lease["expired"] is False and lease["expires_in"] > 0
    alone = run_cli("--backend", store.url, "timeline", "--json", "--key", "cron:")
    assert [lease["token"] for lease in json.loads(alone.stdout)["leases"]] == [other.token]


def test_without_output_nor_json_is_a_usage_error(file_store: CliStore) -> None:
    result = run_cli("--backend", file_store.url, "timeline")
    assert result.returncode == 2 and "-o FILE.svg" in result.stderr and "--json" in result.stderr


def test_an_output_in_a_missing_directory_says_it_cannot_write_there(
    file_store: CliStore, tmp_path: Path
) -> None:
    target = tmp_path / "nowhere" / "t.svg"
    result = run_cli("--backend", file_store.url, "timeline", "-o", str(target))
    assert result.returncode == 1
    assert result.stderr.strip() == f"Error: cannot write {target}: No such file or directory"
