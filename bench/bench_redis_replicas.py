"""What ``replicas=1`` costs a Redis store: uncontended pairs on a primary with a replica.

    python bench/bench_redis_replicas.py [--rounds 7] [--seconds 1.0]

Starts a private ``redis-server`` primary and its replica (``--replicaof``, no persistence)
on free ports, and measures, interleaved round by round:
- ``floor``: ``SET key token NX PX`` + an ``EVALSHA`` of a Lua compare-and-delete (the
  floor of ``bench_redis.py``);
- ``floor + WAIT``: the same, the compare-and-delete and ``WAIT 1 1000`` pipelined in one
  round trip: the floor of a release that returns once the replica has it;
- ``celery_dlock``: ``RedisBackend.try_acquire`` + ``release``, ``replicas`` off (default);
- ``celery_dlock replicas=1``: the same with ``?replicas=1`` (the release, then the
  bucket's ``synced`` key written and ``WAIT 1`` in one more round trip).

Prints each variant's pairs/s and latency and two same-round ratios: ``replicas=1`` to
``floor + WAIT`` (its floor; the target I would set: ≥ 0.8, as for the store without
replicas against its own floor) and to ``celery_dlock`` without replicas (what turning it
on costs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import redis
from benchlib import interleaved, print_table, ratio_per_round

from celery_dlock import Holder, Outcome
from celery_dlock.backends.redis import RedisBackend
from tests.support.redis_pair import Pair

CAD = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
FLOOR, WAITED = "floor", "floor + WAIT"
OURS, CONFIRMED = "celery_dlock", "celery_dlock replicas=1"


def variants(pair: Pair) -> dict[str, object]:
    r = redis.Redis(port=pair.primary, socket_timeout=5.0)
    cad = r.script_load(CAD)
    execute = r.execute_command
    connection = r.connection_pool.get_connection()

    def floor() -> None:
        token = os.urandom(16).hex()
        execute("SET", "floor", token, "NX", "PX", 10000)
        execute("EVALSHA", cad, 1, "floor", token)

    def waited() -> None:
        token = os.urandom(16).hex()
        connection.send_command("SET", "waited", token, "NX", "PX", 10000)
        connection.read_response()
        release = connection.pack_command("EVALSHA", cad, 1, "waited", token)
        connection.send_packed_command([*release, *connection.pack_command("WAIT", 1, 1000)])
        connection.read_response()
        if connection.read_response() < 1:
            raise RuntimeError("the replica did not acknowledge")

    def pair_of(backend: RedisBackend, key: str) -> object:
        holder = Holder.current()

        def run() -> None:
            lease = backend.try_acquire(key, holder, 10)
            assert lease is not None
            backend.release(lease, Outcome.SUCCEEDED)

        return run

    plain = RedisBackend.from_url(pair.url("prefix=bench"))
    confirmed = RedisBackend.from_url(pair.url("prefix=bench&replicas=1"))
    return {
        FLOOR: floor,
        WAITED: waited,
        OURS: pair_of(plain, "job:bench:plain"),
        CONFIRMED: pair_of(confirmed, "job:bench:confirmed"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.0)
    options = parser.parse_args()
    pair = Pair(Path(tempfile.mkdtemp(prefix="dlock-pair-")))
    try:
        print(f"a primary and its replica, load average {os.getloadavg()[0]:.1f}")
        print(f"{options.rounds} rounds × {options.seconds} s, interleaved round by round")
        results = interleaved(variants(pair), options.rounds, options.seconds)  # type: ignore[arg-type]
        print_table(results, floor=FLOOR)
        for name, base in ((WAITED, "its floor, floor + WAIT"), (OURS, "replicas off")):
            ratios = ratio_per_round(results, CONFIRMED, name)
            print(
                f"{CONFIRMED} / {base}: {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}–{max(ratios):.2f})"
            )
    finally:
        pair.stop()


if __name__ == "__main__":
    main()
