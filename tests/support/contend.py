"""One contender of the contention test:
``python contend.py URL KEY ROUNDS COUNTER_FILE LOG_FILE START_FILE``.

Waits until START_FILE exists (so all contenders start together), then ROUNDS times: takes
the lock (waiting without limit), reads the counter, yields the CPU, writes counter + 1,
appends the lease's fence to the log, releases. Without mutual exclusion updates are lost.
"""

from __future__ import annotations

import os
import sys
import time

from celery_dlock import Lock, backend_from_url


def main() -> None:
    url, key, rounds, counter, log, start = sys.argv[1:7]
    backend = backend_from_url(url)
    while not os.path.exists(start):
        time.sleep(0.01)
    for _ in range(int(rounds)):
        lock = Lock(backend, key, wait=None)
        lease = lock.acquire()
        with open(counter) as f:
            value = int(f.read() or 0)
        time.sleep(0)
        with open(counter, "w") as f:
            f.write(str(value + 1))
        with open(log, "a") as f:
            f.write(f"{lease.fence}\n")
        lock.release()
    backend.close()


if __name__ == "__main__":
    main()
