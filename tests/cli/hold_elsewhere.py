"""Hold a lock as a holder of another host until killed: ``python hold_elsewhere.py URL KEY``.

The holder names a host, pid and boot that are not this machine's, as a Celery worker's
lease does to an operator who lists leases from another machine: no process check here can
tell whether it lives. Prints the lease as one JSON line once it is held, then sleeps.
"""

from __future__ import annotations

import json
import sys
import time

from celery_dlock import backend_from_url
from celery_dlock.records import Holder

#: A holder of another machine (another boot and pid namespace than this one's).
ELSEWHERE = Holder(
    host="worker-7.elsewhere",
    pid=4242,
    started=1234.5,
    host_id="00000000-0000-0000-0000-000000000007/pid:[4026531836]",
    nonce="e1sewhere0000007",
    worker="celery@worker-7.elsewhere",
    task_id="task-elsewhere-7",
    task_name="shop.charge",
)


def main() -> None:
    url, key = sys.argv[1], sys.argv[2]
    lease = backend_from_url(url).try_acquire(key, ELSEWHERE, None)
    print(json.dumps(None if lease is None else lease.to_dict()), flush=True)
    if lease is None:
        sys.exit(3)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
