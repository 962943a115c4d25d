"""Shared measuring for the benchmarks in ``bench/``.

Every benchmark measures its floor in the same run as the thing it judges: variants run in
interleaved rounds (A B C, A B C, ...) so that noise from other jobs on the machine hits all
of them alike, and each result is the median over rounds with the min-max beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """Timings of one variant in one round."""

    ops_per_s: float
    p50_us: float
    p99_us: float


@dataclass
class Result:
    name: str
    samples: list[Sample] = field(default_factory=list)

    def median(self, attribute: str) -> float:
        return statistics.median(getattr(s, attribute) for s in self.samples)

    def spread(self, attribute: str) -> tuple[float, float]:
        values = [getattr(s, attribute) for s in self.samples]
        return min(values), max(values)


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def measure(operation: Callable[[], object], seconds: float, warmup: float = 0.2) -> Sample:
    """Run ``operation`` repeatedly for ``seconds`` (after a warm-up) and time each call."""
    clock = time.perf_counter
    end = clock() + warmup
    while clock() < end:
        operation()
    durations: list[float] = []
    start = clock()
    end = start + seconds
    now = start
    while now < end:
        operation()
        after = clock()
        durations.append(after - now)
        now = after
    durations.sort()
    return Sample(
        ops_per_s=len(durations) / (now - start),
        p50_us=percentile(durations, 0.50) * 1e6,
        p99_us=percentile(durations, 0.99) * 1e6,
    )


def interleaved(
    variants: dict[str, Callable[[], object]], rounds: int, seconds: float
) -> dict[str, Result]:
    """Measure every variant once per round, rounds interleaved."""
    results = {name: Result(name) for name in variants}
    for _ in range(rounds):
        for name, operation in variants.items():
            results[name].samples.append(measure(operation, seconds))
    return results


def ratio_per_round(results: dict[str, Result], name: str, floor: str) -> list[float]:
    """ops/s of ``name`` over ops/s of ``floor``, round by round (same-round pairs)."""
    return [
        ours.ops_per_s / base.ops_per_s
        for ours, base in zip(results[name].samples, results[floor].samples, strict=True)
    ]


def print_table(results: dict[str, Result], floor: str, unit: str = "pairs") -> None:
    """Print ops/s, p50, p99 and the same-round ratio to ``floor`` for every variant."""
    header = f"| variant | {unit}/s | p50 µs | p99 µs | ratio to {floor} |"
    print(header)
    print("|" + "---|" * 5)
    for name, result in results.items():
        low, high = result.spread("ops_per_s")
        ratios = ratio_per_round(results, name, floor)
        print(
            f"| {name} | {result.median('ops_per_s'):,.0f} ({low:,.0f}–{high:,.0f}) "
            f"| {result.median('p50_us'):.1f} | {result.median('p99_us'):.1f} "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |"
        )


def latency_summary(durations_s: list[float]) -> tuple[float, float]:
    """(p50, p99) in microseconds."""
    values = sorted(durations_s)
    return percentile(values, 0.5) * 1e6, percentile(values, 0.99) * 1e6


def our_variants(
    backend: Any, key: str = "job:bench", ttl: float | None = None
) -> dict[str, Callable[[], object]]:
    """celery-dlock's two uncontended variants on ``backend``: a bare ``try_acquire`` +
    ``release`` pair on ``key``, and a ``with Lock(...)`` block (no renewal thread)."""
    from celery_dlock import Lock, Outcome
    from celery_dlock.records import Holder

    holder = Holder.current()

    def pair() -> None:
        lease = backend.try_acquire(key, holder, ttl)
        assert lease is not None
        backend.release(lease, Outcome.SUCCEEDED)

    def lock() -> None:
        with Lock(backend, f"{key}-lock", ttl=ttl, renew=False):
            pass

    return {"celery_dlock": pair, "celery_dlock Lock": lock}
