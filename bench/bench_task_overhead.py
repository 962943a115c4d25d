"""The layers' cost per task, in process: a LockedTask through Celery's real tracer on the
memory store, against the same plain task, with the store's own calls timed apart.

    python bench/bench_task_overhead.py [--tasks 20000] [--rounds 5]
    python -m cProfile -s tottime bench/bench_task_overhead.py --rounds 1 --only locked
    py-spy record --nonblocking -r 2000 -f raw -o profile.txt -- \
        python bench/bench_task_overhead.py --rounds 2 --only locked --tasks 50000

(py-spy from pip; ``--nonblocking``: pausing the process for each sample makes its system
calls look ten times dearer, ``os.getpid`` among them.) Instructions per task, which this
shared VM's CPU times swing too much to show for a change of 1 µs: the difference of two
runs under callgrind, divided by the difference of their task counts (repeatable to 0.3%):

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/n.out \
        python bench/bench_task_overhead.py --rounds 1 --only locked --tasks N

Celery's ``build_tracer`` runs each task as a worker child would (request context, signals,
result handling with ``ignore_result``), with no broker and no other process, so the CPU per
task is all Python: ``plain`` is Celery's own floor, ``LockedTask`` adds the key, the Lock,
the task's bookkeeping and two store calls (try_acquire, release) on a memory store whose
calls are timed apart (``store``). ``layers`` = LockedTask - plain - store: what the Lock and
LockedTask layers cost beyond the store; ``metered`` is LockedTask with the Prometheus
metrics on (``prometheus_client`` in this process's registry). Variants interleave round by
round; medians of the rounds, min-max beside them. Targets: layers <= 20 µs per task
(issue 14), metrics <= 5 µs more (issue 16).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.app.trace import build_tracer

from celery_dlock import Holder, LockedTask, install, metrics
from celery_dlock.celery.settings import backend_for

TARGET_US = 20.0
#: What the Prometheus metrics may add per task (issue 16).
METRICS_TARGET_US = 5.0


class Spent:
    """Seconds spent inside the store's calls."""

    total = 0.0


def timed(call: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            Spent.total += time.perf_counter() - start

    return wrapper


def make_app() -> tuple[Celery, Any, Any]:
    name = f"bench-overhead-{uuid.uuid4().hex[:6]}"
    app = Celery("bench_overhead", set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        dlock_backend=f"memory://{name}",
        broker_url="memory://",
    )
    install(app)
    store = backend_for(app)  # the app's store in this process: its calls timed
    store.try_acquire = timed(store.try_acquire)  # type: ignore[method-assign]
    store.release = timed(store.release)  # type: ignore[method-assign]

    @app.task(name="b.plain", shared=False)
    def plain(n: int) -> int:
        return n

    @app.task(name="b.locked", shared=False, base=LockedTask, lock_key="bench:{n}")
    def locked(n: int) -> int:
        return n

    return app, plain, locked


def per_task_us(tracer: Any, task: Any, count: int, counter: Any) -> tuple[float, float]:
    """CPU µs per task, and µs of it inside the store's calls."""
    Spent.total = 0.0
    start = time.process_time()
    for _ in range(count):
        n = next(counter)
        tracer(uuid.uuid4().hex, (n,), {}, {"delivery_info": {}, "hostname": "bench@host"})
    cpu = time.process_time() - start
    return cpu / count * 1e6, Spent.total / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["plain", "locked", "metered"])
    options = parser.parse_args()
    app, plain_proxy, locked_proxy = make_app()
    # The registered tasks, as a worker builds its tracers (``app.tasks[name]``): the
    # decorator's lazy proxies would cost every call an indirection no worker pays (about
    # 3 µs on plain and 8 µs on LockedTask, measured).
    plain, locked = app.tasks[plain_proxy.name], app.tasks[locked_proxy.name]
    locked_tracer = build_tracer(locked.name, locked, app=app, eager=False)
    tracers = {
        "plain": (build_tracer(plain.name, plain, app=app, eager=False), plain),
        "locked": (locked_tracer, locked),
        "metered": (locked_tracer, locked),  # the same task, with the metrics on
    }
    if options.only:
        tracers = {options.only: tracers[options.only]}
    counter = itertools.count()
    Holder.current()  # warm the host facts
    metrics.enable()
    for name, (tracer, task) in tracers.items():
        switch(name)
        per_task_us(tracer, task, 2000, counter)  # warm-up
    store = backend_for(app)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in tracers}
    for _ in range(options.rounds):
        for name, (tracer, task) in tracers.items():
            switch(name)
            # The memory store keeps its history in this process; a real store keeps it
            # in its server. Left to grow (20,000 records a round), it is garbage the
            # collector walks, and later rounds would cost more than earlier ones.
            store.prune_history(time.time())
            results[name].append(per_task_us(tracer, task, options.tasks, counter))
    print(f"{options.tasks} tasks x {options.rounds} rounds through Celery's tracer, in process")
    print("| variant | CPU µs/task | of it in the store |")
    print("|---|---|---|")
    for name, samples in results.items():
        cpu = [s[0] for s in samples]
        store = [s[1] for s in samples]
        print(
            f"| {name} | {statistics.median(cpu):.1f} ({min(cpu):.1f}-{max(cpu):.1f}) "
            f"| {statistics.median(store):.1f} |"
        )
    if "plain" in results and "locked" in results:
        layers = [
            lock[0] - base[0] - lock[1]
            for lock, base in zip(results["locked"], results["plain"], strict=True)
        ]
        median = statistics.median(layers)
        verdict = "meets" if median <= TARGET_US else "MISSES"
        print(
            f"\nlayers (LockedTask - plain - store) = {median:.1f} µs per task "
            f"({min(layers):.1f}-{max(layers):.1f}; {verdict} the target of <= {TARGET_US:.0f})"
        )

    if "metered" in results and "locked" in results:
        cost = [
            on[0] - off[0] for on, off in zip(results["metered"], results["locked"], strict=True)
        ]
        median = statistics.median(cost)
        verdict = "meets" if median <= METRICS_TARGET_US else "MISSES"
        print(
            f"metrics on (prometheus_client) = {median:.1f} µs more per task "
            f"({min(cost):.1f}-{max(cost):.1f}; {verdict} the target of <= "
            f"{METRICS_TARGET_US:.0f})"
        )


def switch(name: str) -> None:
    """Metrics on for the ``metered`` variant only."""
    if name == "metered":
        metrics.enable()
    else:
        metrics.disable()


if __name__ == "__main__":
    main()
