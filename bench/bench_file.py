"""File backend: uncontended acquire+release pairs against a raw O_CREAT|O_EXCL floor.

    python bench/bench_file.py [--rounds 5] [--seconds 1.0] [--dir /tmp]

All variants run in one directory, interleaved round by round:
- ``raw O_EXCL`` (the floor): ``os.open(O_CREAT|O_EXCL)`` + close + unlink, no content.
- ``system calls of a pair``: the eleven system calls one ``celery_dlock`` pair makes, with
  none of its logic: per acquire and release ``flock``, ``fstat`` (is the file still linked),
  ``pread``, ``pwrite`` of a state of the same size, ``flock(LOCK_UN)``, and the release's
  history line appended (tokens come 256 to a ``getrandom``). What the store's protocol
  costs in the kernel, the floor of any Python code that keeps it.
- ``celery_dlock``: ``FileBackend.try_acquire`` + ``release``, with fence and a history record.
- ``celery_dlock Lock``: the same through ``with Lock(...)`` (holder, context manager).
- ``filelock`` (if installed): ``FileLock`` acquire + release, for comparison.
Targets: celery_dlock ≥ 0.3× the floor (issue 2); through ``Lock`` ≥ 0.5× (issue 14).
filelock reaches 0.05× on this machine type.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from benchlib import interleaved, our_variants, print_table, ratio_per_round

from celery_dlock.backends.file import FileBackend

SYSCALLS = "system calls of a pair"
#: A lease's state as the store writes it (about this size), and a history line.
_STATE = b'{"key":"job:bench","fence":1,"lease":{' + b"x" * 330 + b"}}"
_LINE = b'{"lease":{' + b"x" * 420 + b"}}\n"


def system_calls(directory: str) -> Callable[[], None]:
    """The system calls of one acquire + release of the file store, and nothing else."""
    fd = os.open(os.path.join(directory, "syscalls.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    history = os.open(os.path.join(directory, "syscalls.jsonl"), flags, 0o600)
    free = b'{"key":"job:bench","fence":1,"lease":null}'.ljust(len(_STATE))

    def pair() -> None:
        for state in (_STATE, free):
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.fstat(fd)
            os.pread(fd, 4096, 0)
            if state is free:
                os.write(history, _LINE)
            os.pwrite(fd, state, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)

    return pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where to put the files (default: a temp dir)")
    options = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=options.dir) as directory:
        raw_path = os.path.join(directory, "raw.lock")

        def raw() -> None:
            fd = os.open(raw_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.close(fd)
            os.unlink(raw_path)

        backend = FileBackend(os.path.join(directory, "dlock"))
        variants: dict[str, Callable[[], object]] = {
            "raw O_EXCL": raw,
            SYSCALLS: system_calls(directory),
            **our_variants(backend),
        }
        try:
            from filelock import FileLock

            file_lock = FileLock(os.path.join(directory, "filelock.lock"))

            def filelock_pair() -> None:
                file_lock.acquire()
                file_lock.release()

            variants["filelock"] = filelock_pair
        except ImportError:
            print("filelock is not installed: pip install filelock to compare")

        print(f"file backend, {options.rounds} rounds × {options.seconds} s, dir {directory}")
        results = interleaved(variants, options.rounds, options.seconds)
        print_table(results, floor="raw O_EXCL")
        print()
        for name, target in (("celery_dlock", 0.3), ("celery_dlock Lock", 0.5)):
            ratio = statistics.median(ratio_per_round(results, name, "raw O_EXCL"))
            verdict = "meets" if ratio >= target else "MISSES"
            print(f"{name} / raw O_EXCL = {ratio:.2f} ({verdict} the target of ≥ {target:.2f})")
        for name in ("celery_dlock", "celery_dlock Lock"):
            share = statistics.median(ratio_per_round(results, name, SYSCALLS))
            print(f"{name} / its {SYSCALLS} = {share:.2f}")
        records = len(backend.history(limit=None))
        print(f"history records written during the run: {records:,}")
        backend.close()


if __name__ == "__main__":
    main()
