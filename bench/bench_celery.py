"""Celery end to end: no-op task throughput through a real prefork worker (Redis broker).

    python bench/bench_celery.py [--tasks 2000] [--rounds 4] [--store postgres|file|redis]

Variants, interleaved round by round, each with a fresh `worker --pool=prefork -c 2`:
- ``plain``: a plain Celery task (the floor).
- ``LockedTask``: the same body under a celery-dlock lock, a distinct key per task.
- ``advisory_floor`` (with ``--store postgres``): a raw ``pg_try_advisory_lock`` /
  ``pg_advisory_unlock`` pair around the body: what any Postgres lock costs at least.
- ``advisory_one_trip`` (with ``--store postgres``): one raw statement per task that unlocks
  the previous task's key and locks this one: the floor of a lock whose release is deferred
  to the next acquire (one round trip per task, the key held until the next task comes).
- ``redis_floor`` (with ``--store redis``): ``SET NX PX`` and a Lua compare-and-delete
  around the body, with redis-py: what any Redis lock taken in the worker that releases by
  its token costs at least (celery-singleton's ``DEL`` checks no token).
- ``celery-once`` and ``celery-singleton`` (if installed): their locks, for comparison.
Throughput = N / (first send → the N-th body has run); each body is one Redis INCR.
Target (issue 4): LockedTask ≥ 0.92× plain; on this machine type celery-singleton reached
0.90× and celery-once 0.81× (shared/notes/anchor-benchmarks.md, table C). Issue 14:
LockedTask ≥ 0.95× the raw advisory pair (``--store postgres``) and ≥ 1.0× celery-singleton
(``--store redis``), paired per round; run ``--rounds 10`` or more. The raw Redis token lock
(``redis_floor``) itself reached 0.99× celery-singleton on 2026-11-27 (0.96–1.03, 10 rounds):
a lock taken in the worker and released by its token, before any fence or record, costs what
celery-singleton's ``SET NX`` in the producer and bare ``DEL`` cost.

Each run also counts the CPU time that the same window cost: the worker and its children,
every ``postgres`` and ``redis-server`` process (broker, lock stores, anchors' Redis) and the
producer (this process). On a saturated machine throughput is cores / CPU per task, so
``plain CPU / variant CPU`` is the throughput ratio the machine's capacity allows, and the CPU
figures show where a variant's cost goes. On a shared 2-core VM both views swing by about
±15% from run to run: compare the paired medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

HERE = Path(__file__).parent
REDIS = "redis://127.0.0.1:6379"
BROKER_DB, COUNTER_DB = 6, 7
WARMUP = 50
#: Issue 14: LockedTask against the raw advisory pair (Postgres), and against
#: celery-singleton taking its lock in the same Redis, paired per round.
FLOOR_TARGET = 0.95
PEER_TARGET = 1.0


def store_url(kind: str, scratch: Path) -> str:
    if kind == "file":
        return f"file://{scratch}/locks"
    if kind == "redis":
        return f"{REDIS}/{COUNTER_DB}?prefix=bench-{uuid.uuid4().hex[:6]}"
    schema = f"dlock_bench_{uuid.uuid4().hex[:8]}"
    return f"postgresql://postgres@127.0.0.1:5432/test?schema={schema}&auto_migrate=1"


def cpu_seconds(worker: int) -> float:
    """CPU time used so far by the worker and its children, Postgres, Redis and us."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                text = stat.read()
        except OSError:  # gone meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        pid, parent = int(entry.name), int(fields[1])
        if (
            pid in (worker, os.getpid())
            or parent == worker
            or name.startswith(("postgres", "redis-server"))
        ):
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def run_once(variant: str, tasks: int, env: dict[str, str]) -> tuple[float, float]:
    """Tasks per second, and CPU seconds per task, for one variant with a fresh worker."""
    counter = redis.Redis.from_url(env["BENCH_COUNTER"])
    redis.Redis.from_url(env["BENCH_BROKER"]).flushdb()
    counter.flushdb()
    sys.path.insert(0, str(HERE))
    import celery_bench_app

    app = celery_bench_app.app
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_bench_app", "worker",
         "--pool=prefork", "--concurrency=2", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "--loglevel=WARNING", f"--hostname=bench-{variant}@%h"],
        cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(timeout=0.5):
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError("the worker did not start")
        task = app.tasks[f"bench.{variant}"]
        # Warm up: each child's first tasks open its connections (broker, lock store).
        for i in range(WARMUP):
            task.delay(-1 - i)
        while int(counter.get("bench:done") or 0) < WARMUP:
            time.sleep(0.002)
        counter.set("bench:done", 0)
        cpu = cpu_seconds(worker.pid)
        started = time.perf_counter()
        for i in range(tasks):
            task.delay(i)
        while int(counter.get("bench:done") or 0) < tasks:
            if time.perf_counter() - started > 300:
                raise RuntimeError(f"{variant}: only {counter.get('bench:done')} of {tasks} ran")
            time.sleep(0.002)
        elapsed = time.perf_counter() - started
        return tasks / elapsed, (cpu_seconds(worker.pid) - cpu) / tasks
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        if worker.stderr is not None:
            errors = worker.stderr.read().decode(errors="replace")
            worker.stderr.close()
            if "Traceback" in errors:
                print(errors[-3000:], file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--store", choices=["postgres", "file", "redis"], default="postgres")
    options = parser.parse_args()

    scratch = Path(f"/tmp/dlock-bench-{uuid.uuid4().hex[:6]}")
    scratch.mkdir()
    locks = store_url(options.store, scratch)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "BENCH_BROKER": f"{REDIS}/{BROKER_DB}",
        "BENCH_COUNTER": f"{REDIS}/{COUNTER_DB}",
        "BENCH_LOCKS": locks,
        "BENCH_PG": "postgresql://postgres@127.0.0.1:5432/test",
    }
    os.environ.update({k: v for k, v in env.items() if k.startswith("BENCH_")})
    variants = ["plain", "locked"]
    if options.store == "postgres":
        variants += ["advisory_floor", "advisory_one_trip"]
    if options.store == "redis":
        variants.append("redis_floor")
    for optional, module in (("once", "celery_once"), ("singleton", "celery_singleton")):
        try:
            __import__(module)
            variants.append(optional)
        except ImportError:
            print(f"{module} is not installed: pip install 'celery-dlock[bench]' to compare")
    print(f"{options.tasks} no-op tasks × {options.rounds} rounds, prefork -c 2, "
          f"LockedTask store: {options.store}")  # fmt: skip
    rates: dict[str, list[float]] = {v: [] for v in variants}
    cpus: dict[str, list[float]] = {v: [] for v in variants}
    for round_number in range(options.rounds):
        # Rotate the order each round, so that no variant always runs first.
        shift = round_number % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            rate, cpu = run_once(variant, options.tasks, env)
            rates[variant].append(rate)
            cpus[variant].append(cpu)
        line = ", ".join(f"{v} {rates[v][-1]:.0f}/s {cpus[v][-1] * 1e3:.2f} ms" for v in variants)
        print(f"round {round_number + 1}: {line}", flush=True)
    report(variants, rates, cpus, options.store)


def report(
    variants: list[str], rates: dict[str, list[float]], cpus: dict[str, list[float]], store: str
) -> None:
    """The table of the rounds, and each target's paired ratio."""
    print(
        "\n| variant | tasks/s (min–max) | ratio to plain, paired per round (min–max) "
        "| CPU ms per task (min–max) | plain CPU / CPU, paired (min–max) |"
    )
    print("|---|---|---|---|---|")
    names = {"plain": "plain Celery", "locked": f"LockedTask ({store})",
             "advisory_floor": "raw pg advisory lock/unlock (floor of any Postgres lock)",
             "advisory_one_trip": "raw pg advisory, one statement per task (deferred unlock)",
             "redis_floor": "raw Redis SET NX PX + compare-and-delete (floor of a token lock)",
             "once": "celery-once", "singleton": "celery-singleton"}  # fmt: skip
    for variant in variants:
        ratios = [r / p for r, p in zip(rates[variant], rates["plain"], strict=True)]
        used = [c * 1e3 for c in cpus[variant]]
        spare = [p / c for c, p in zip(cpus[variant], cpus["plain"], strict=True)]
        print(
            f"| {names[variant]} | {statistics.median(rates[variant]):,.0f} "
            f"({min(rates[variant]):,.0f}–{max(rates[variant]):,.0f}) "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) "
            f"| {statistics.median(used):.2f} ({min(used):.2f}–{max(used):.2f}) "
            f"| {statistics.median(spare):.2f} ({min(spare):.2f}–{max(spare):.2f}) |"
        )
    locked_ratio = statistics.median(
        r / p for r, p in zip(rates["locked"], rates["plain"], strict=True)
    )
    verdict = "meets" if locked_ratio >= 0.92 else "MISSES"
    print(f"\nLockedTask / plain = {locked_ratio:.2f} ({verdict} the target of ≥ 0.92)")
    capacity = statistics.median(p / c for c, p in zip(cpus["locked"], cpus["plain"], strict=True))
    print(f"by CPU per task (capacity of a saturated machine): {capacity:.2f}")
    if "advisory_floor" in rates:
        to_floor = statistics.median(
            r / f for r, f in zip(rates["locked"], rates["advisory_floor"], strict=True)
        )
        floor = statistics.median(
            f / p for f, p in zip(rates["advisory_floor"], rates["plain"], strict=True)
        )
        verdict = "meets" if to_floor >= FLOOR_TARGET else "MISSES"
        print(
            f"the raw advisory floor itself is {floor:.2f}× plain; LockedTask reaches "
            f"{to_floor:.2f}× that floor, paired ({verdict} the target of ≥ {FLOOR_TARGET}), "
            "while also writing the lease row, fence and history"
        )
        floor_cpu = statistics.median(
            p / f for f, p in zip(cpus["advisory_floor"], cpus["plain"], strict=True)
        )
        print(f"by CPU per task: the floor is {floor_cpu:.2f}× plain, LockedTask {capacity:.2f}×")
        one_trip = statistics.median(
            f / p for f, p in zip(rates["advisory_one_trip"], rates["plain"], strict=True)
        )
        print(
            f"one raw advisory statement per task (a release deferred to the next acquire, "
            f"nothing written) is {one_trip:.2f}× plain"
        )

    if "redis_floor" in rates:
        to_floor = [r / f for r, f in zip(rates["locked"], rates["redis_floor"], strict=True)]
        floor = statistics.median(
            f / p for f, p in zip(rates["redis_floor"], rates["plain"], strict=True)
        )
        print(
            f"the raw Redis token lock is {floor:.2f}× plain; LockedTask reaches "
            f"{statistics.median(to_floor):.2f}× it, paired ({min(to_floor):.2f}–"
            f"{max(to_floor):.2f}), while also writing the fence and the history record"
        )
        if "singleton" in rates:
            floor_to_peer = statistics.median(
                f / s for f, s in zip(rates["redis_floor"], rates["singleton"], strict=True)
            )
            print(f"the raw Redis token lock / celery-singleton, paired = {floor_to_peer:.2f}")

    if "singleton" in rates:
        to_peer = [r / s for r, s in zip(rates["locked"], rates["singleton"], strict=True)]
        verdict = "meets" if statistics.median(to_peer) >= PEER_TARGET else "MISSES"
        print(
            f"LockedTask / celery-singleton, paired = {statistics.median(to_peer):.2f} "
            f"({min(to_peer):.2f}–{max(to_peer):.2f}; {verdict} the target of ≥ {PEER_TARGET})"
        )


if __name__ == "__main__":
    main()
