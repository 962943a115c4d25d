"""One run of a ``once`` task, eagerly, in a process of its own: the lost-lease tests start
it, lose its lease while its body runs (the store's own way), and run it again.

    python once_runner.py URL NAMESPACE DIR ORDER [--ttl SECONDS] [--hold]

Every body that runs appends ``{"pid", "fence", "token"}`` to ``DIR/runs``. With ``--hold``
the body writes the same to ``DIR/held`` and waits for ``DIR/go`` before it returns. The
task's result is printed as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

TASK = "t.lost_charge"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("namespace")
    parser.add_argument("dir", type=Path)
    parser.add_argument("order")
    parser.add_argument("--ttl", type=float, default=None)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()

    from celery import Celery

    from celery_dlock import LockedTask

    app = Celery("once_runner", set_as_current=True)
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        dlock_backend=args.url,
        dlock_namespace=args.namespace,
    )

    @app.task(
        shared=False, base=LockedTask, bind=True, name=TASK, lock_key="order:{order}", once=True
    )
    def charge(self: Any, order: str) -> dict[str, Any]:
        seen = {"pid": os.getpid(), "fence": self.lease.fence, "token": self.lease.token}
        with open(args.dir / "runs", "a") as f:
            f.write(json.dumps(seen) + "\n")
        if args.hold:
            # whole or absent: the test polls for the file and reads it at once
            (args.dir / "held.part").write_text(json.dumps(seen))
            os.replace(args.dir / "held.part", args.dir / "held")
            while not (args.dir / "go").exists():
                time.sleep(0.02)
        return {"order": order, **seen}

    charge.lock_ttl = args.ttl
    result = charge.apply((args.order,)).get()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
