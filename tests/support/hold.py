"""Hold a lock until killed: ``python hold.py URL KEY [TTL [HAND_OVER_TTL [RENEW_TTL]]]``.

Prints the lease as one JSON line once it is held (handed over to live by
``HAND_OVER_TTL`` alone, if given: ``LockBackend.hand_over``; after a renewal to
``RENEW_TTL``, if given, and then only if unchanged since granted, as a dedupe mark's
producer hands its mark over after a worker's renewal), then sleeps. Tests SIGKILL it.
"""

from __future__ import annotations

import json
import sys
import time

from celery_dlock import backend_from_url
from celery_dlock.records import Holder


def main() -> None:
    url, key = sys.argv[1], sys.argv[2]
    ttl = float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    hand_over = float(sys.argv[4]) if len(sys.argv) > 4 else None
    renew = float(sys.argv[5]) if len(sys.argv) > 5 else None
    backend = backend_from_url(url)
    lease = backend.try_acquire(key, Holder.current(task_name="tests.hold"), ttl)
    if lease is None:
        print(json.dumps(None), flush=True)
        sys.exit(3)
    if renew is not None:
        assert backend.renew(lease, renew) is not None
    if hand_over is not None:
        lease = backend.hand_over(lease, hand_over, if_unchanged=renew is not None)
    print(json.dumps(lease.to_dict()), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
