"""``python -m bench.torture --store file|postgres|redis [--short|--long] ...``: see the
package's docstring. Prints the results table; exits 1 if any invariant was violated."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from . import __doc__ as overview
from . import netns
from .check import Report, table
from .run import Settings, torture
from .servers import STORES

#: ``--short``: the CI run, a few thousand acquisitions per store in about 10 s; the file
#: store's disk full twice (as root). 7 s, not 10: the seven short runs took an eighth of
#: the CPU of a CI run (each holds the machine for its time), and a run short of
#: ``--at-least`` acquisitions goes on without faults until it has them.
SHORT = {"seconds": 7.0, "kills": 4, "pauses": 1, "restarts": 2, "diskfulls": 2}
#: ``--short`` per store where it differs: a Redis Cluster failover takes about 4 s; the
#: object stores keep 10 s (3-5 ms a call: at 7 s a loaded CI run made 68 acquisitions on S3,
#: short of the test's 100).
SHORT_SECONDS = {"redis-cluster": 15.0, "s3": 10.0, "gcs": 10.0}
#: ``--long``: the issue's long mode: a million acquisitions on each of file, Postgres and
#: Redis, over 10,000 on S3 and GCS, on two cores (32 keys and sections of at most 0.5 ms,
#: unless ``--keys`` and ``--hold`` say otherwise: 8 keys and 3 ms would need hours).
LONG = {"kills": 120, "pauses": 30, "restarts": 6, "partitions": 10}
LONG_SECONDS = {
    "file": 1000.0, "redis": 1450.0, "redis-cluster": 1200.0, "postgres": 2200.0,
    "pgbouncer": 2200.0, "s3": 240.0, "gcs": 420.0,
}  # fmt: skip
LONG_SHAPE = {"keys": 32, "hold": 0.0005}
#: Lease ttl and Lock wait (s) where ``--ttl`` and ``--wait`` are not given: 3 and 2, but 1 and
#: 1 for the object stores (3-5 ms a call, a waiter polling up to 1 s apart: a killed holder's
#: key held for a 3 s ttl would leave a short run with few acquisitions).
TIMING = {"s3": (1.0, 1.0), "gcs": (1.0, 1.0)}


def _check_shape(
    parser: argparse.ArgumentParser, options: argparse.Namespace, keys: int, partitions: int
) -> None:
    """``--limit`` and ``--together``: counts, one at a time, not with ``--broken``, and no
    more keys together than there are; ``--hand-over``: a key at a time, each with a ttl."""
    if options.limit < 1 or (options.broken and options.limit > 1):
        parser.error("--limit: a count >= 1, and 1 with --broken (its lock takes the key itself)")
    if options.together < 1 or (options.together > 1 and (options.broken or options.limit > 1)):
        parser.error("--together: a count >= 1, and 1 with --broken or --limit")
    if options.asyncio and (options.broken or options.together > 1):
        parser.error("--asyncio: a key at a time (AsyncLock), not with --broken or --together")
    if options.hand_over and (
        options.broken or options.limit > 1 or options.together > 1 or options.asyncio
        or partitions
    ):  # fmt: skip
        parser.error(
            "--hand-over: a key at a time through Lock, not with --broken, --limit, "
            "--together, --asyncio or partitions (a cut-off holder has no ttl)"
        )
    if options.together > keys:
        parser.error(f"--together {options.together} needs as many keys, not {keys}")


def parse(argv: list[str]) -> tuple[list[Settings], argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.torture",
        description=overview,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--store",
        required=True,
        help="file, postgres, pgbouncer, redis, redis-cluster, s3, gcs, or several: s3,gcs",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--short", action="store_true", help=f"CI size: {SHORT}")
    mode.add_argument("--long", action="store_true", help=f"the long mode: {LONG}")
    parser.add_argument("--workers", type=int, default=16, help="worker processes (16)")
    parser.add_argument("--keys", type=int, help="keys, key i chosen ~ 1/(i+1) (8; --long 32)")
    parser.add_argument("--seconds", type=float, help="run time per store (60)")
    parser.add_argument("--kills", type=int, help="workers SIGKILLed per store (10)")
    parser.add_argument("--pauses", type=int, help="workers SIGSTOPped for ttl + 1 s (2)")
    parser.add_argument(
        "--restarts",
        type=int,
        help="store restarts (2; redis-cluster: failovers; none for file, s3 and gcs)",
    )
    parser.add_argument(
        "--diskfulls",
        type=int,
        help="the file store's disk full for a second (0; file only: a tmpfs, as root)",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        help="holders cut off the network in their section (0; postgres and redis, as root)",
    )
    parser.add_argument(
        "--cut-off", type=int, default=2, help="workers in the namespace partitions cut (2)"
    )
    for flag, text in {
        "--cut-off-options": "URL options of the cut-off workers, e.g. Postgres keepalives: "
        "keepalives_idle=1&keepalives_interval=1&keepalives_count=2&tcp_user_timeout=3000",
        "--store-options": "more URL options of the store (replicas=1, say)",
    }.items():
        parser.add_argument(flag, default="", help=text)
    parser.add_argument("--ttl", type=float, help="lease ttl (3 s; 1 s for s3 and gcs)")
    parser.add_argument("--wait", type=float, help="Lock wait (2 s; 1 s for s3 and gcs)")
    parser.add_argument(
        "--hold", type=float, help="longest section pause (0.003 s; --long 0.0005 s)"
    )
    parser.add_argument("--ledger", choices=("file", "postgres"), help="where the ledger lives")
    parser.add_argument(
        "--broken", action="store_true", help="use a lock that releases busy keys by key alone"
    )
    parser.add_argument(
        "--at-least",
        type=int,
        default=0,
        help="acquisitions per store: after its faults, run on without faults until it has "
        "made them, for at most --seconds more (0)",
    )
    parser.add_argument(
        "--limit", type=int, default=1, help="holders per key at once, in slots key#i (1)"
    )
    parser.add_argument(
        "--together", type=int, default=1, help="keys taken at once, all or none (1)"
    )
    for flag, text in {
        "--asyncio": "the workers use AsyncLock on an event loop",
        "--hand-over": "each lease handed over once granted (alive by its ttl), released by token",
    }.items():
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the reports here as JSON")
    parser.add_argument("--keep", type=Path, help="copy each run's logs into this directory")
    options = parser.parse_args(argv)
    stores = options.store.split(",")
    unknown = [store for store in stores if store not in STORES]
    if unknown:
        parser.error(f"unknown store {unknown[0]!r}: choose from {', '.join(STORES)}")
    sized = SHORT if options.short else LONG if options.long else {}
    counts = {
        name: getattr(options, name) if getattr(options, name) is not None else sized.get(name)
        for name in ("seconds", "kills", "pauses", "restarts", "partitions", "diskfulls")
    }
    networked = set(stores) & {"postgres", "redis"}
    if counts["partitions"] and networked and (reason := netns.unavailable()) is not None:
        parser.error(f"partitions: {reason} (or pass --partitions 0)")
    if options.diskfulls and (set(stores) - {"file"} or os.geteuid() != 0):
        parser.error("diskfulls: the file store alone, as root (it mounts a tmpfs)")
    common = {name: value for name, value in counts.items() if value is not None}
    # The short mode's full disks: the file store's, as root; none for the other stores.
    fulls = common.pop("diskfulls", 0)
    fulls = fulls if os.geteuid() == 0 else 0
    shape = {"keys": 8, "hold": 0.003, **(LONG_SHAPE if options.long else {})}
    keys = options.keys if options.keys is not None else int(shape["keys"])
    _check_shape(parser, options, keys, counts["partitions"] or 0)
    hold = options.hold if options.hold is not None else float(shape["hold"])
    # The mode's seconds per store, where --seconds does not say.
    per_store = LONG_SECONDS if options.long else SHORT_SECONDS if options.short else {}
    given = options.seconds is not None
    own = {s: {"seconds": per_store[s]} for s in stores if s in per_store and not given}
    runs = [
        Settings(
            store=store, workers=options.workers, keys=keys,
            ttl=options.ttl if options.ttl is not None else TIMING.get(store, (3.0, 2.0))[0],
            wait=options.wait if options.wait is not None else TIMING.get(store, (3.0, 2.0))[1],
            hold=hold, ledger=options.ledger, broken=options.broken,
            seed=options.seed, keep=options.keep, cut_off=options.cut_off,
            at_least=options.at_least, limit=options.limit, together=options.together,
            asyncio=options.asyncio, hand_over=options.hand_over,
            cut_off_options=options.cut_off_options, store_options=options.store_options,
            diskfulls=fulls if store == "file" else 0,
            **{**common, **own.get(store, {})},  # type: ignore[arg-type]
        )
        for store in stores
    ]  # fmt: skip
    return runs, options


def main(argv: list[str]) -> int:
    runs, options = parse(argv)
    reports: list[Report] = []
    for settings in runs:
        report = torture(settings)
        reports.append(report)
        print(f"{settings.store}: {report.violations} violations", file=sys.stderr, flush=True)
        for problem in report.problems:
            print(f"  {problem}", file=sys.stderr)
    print(table(reports))
    for report in reports:
        print(
            f"{report.store}: busy {report.busy}, store errors {report.store_errors} "
            f"(releases {report.release_errors}), "
            f"ledger errors {report.ledger_errors}, "
            f"overlaps fenced {report.fenced_overlaps}, serialized {report.serialized_overlaps}, "
            f"late writes {report.late_writes}, lost releases {report.lost_releases}, "
            f"records checked {report.records_checked} (excused {report.excused_records}; "
            f"acknowledged history lost before a crash: up to {report.crash_loss:.3f} s), "
            f"killed leases {report.killed_outcomes}, restarts {report.restart_kinds or '-'}, "
            f"partitions {report.partitions} (leases freed after "
            f"{', '.join(f'{s:.2f}' for s in report.freed_after) or '-'} s; cut-off releases "
            f"{report.cut_releases or '-'}, their leases {report.cut_outcomes or '-'})"
        )
    if options.json is not None:
        options.json.write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
    return 1 if any(report.violations for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
