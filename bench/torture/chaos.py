"""The workers' processes (:class:`Fleet`) and the chaos thread that kills and pauses them
and restarts the store (:class:`Chaos`), bounded in count and time.

Every fault is written to ``chaos.jsonl`` in the run's directory, with ``time.monotonic()``
taken just before it:

- ``{"e": "kill", "pid", "log", "t", "wall", "in_section"}``: a worker SIGKILLed (then
  started again with a new log), written before the signal. The victim was alive at ``t``,
  so no other holder can have taken its key before ``t``. ``wall`` is ``time.time()``, to
  compare with a ledger server's timestamps.
- ``{"e": "pause", "pid", "log", "t", "in_section"}`` and ``{"e": "resume", "pid", "log",
  "t"}``: a worker SIGSTOPped past its lease's ttl, then SIGCONTed: a holder paused (a long GC,
  a stopped VM) that wakes up in its section after another took its key.
- ``{"e": "restart", "kind", "t", "t_end"}``: the store restarted, written once it answers
  again (``t_end``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .servers import Store
from .worker import Job

__all__ = ["Chaos", "Fleet"]

REPO = Path(__file__).resolve().parents[2]


class Fleet:
    """``count`` worker processes, each with its own log per life."""

    def __init__(self, job: Job, directory: Path, count: int, seed: int) -> None:
        self.job, self.directory, self.count, self.seed = job, directory, count, seed
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, Path] = {}
        self.lives = 0
        self.paused: set[int] = set()  # slots SIGSTOPped now
        self.events = directory / "chaos.jsonl"
        self._lock = threading.Lock()

    def start(self) -> None:
        for slot in range(self.count):
            self._spawn(slot)

    def _spawn(self, slot: int) -> None:
        self.lives += 1
        log = self.directory / f"w{slot:02d}.{self.lives:04d}.jsonl"
        job = dataclasses.replace(self.job, log=str(log), seed=self.seed * 100_003 + self.lives)
        with open(log.with_suffix(".err"), "ab") as err:
            self.processes[slot] = subprocess.Popen(
                [sys.executable, "-m", "bench.torture.worker", job.to_json()],
                cwd=REPO,
                stdout=err,
                stderr=subprocess.STDOUT,
            )
        self.logs[slot] = log

    def in_section(self, slot: int) -> bool:
        """Whether the worker's last log line is a ``begin``."""
        try:
            with open(self.logs[slot], "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 400))
                tail = f.read().splitlines()
        except FileNotFoundError:
            return False
        return bool(tail) and tail[-1].startswith(b'{"e":"begin"')

    def record(self, **event: Any) -> None:
        with self._lock, open(self.events, "a") as f:
            f.write(json.dumps(event) + "\n")

    def kill(self, slot: int, respawn: bool = True) -> None:
        """SIGKILL the worker in ``slot`` (recorded first), and start another in its place."""
        process = self.processes[slot]
        if process.poll() is not None:
            return
        in_section = self.in_section(slot)
        at = time.monotonic()
        log = self.logs[slot].name
        self.record(
            e="kill", pid=process.pid, log=log, t=at, wall=time.time(), in_section=in_section
        )
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        if respawn:
            self._spawn(slot)

    def pause(self, slot: int, seconds: float) -> threading.Timer | None:
        """SIGSTOP the worker in ``slot`` for ``seconds`` (past its lease's ttl, so another
        holder takes its key while it sleeps in its section); returns the timer that will
        SIGCONT it, or None if the worker was not inside a section once stopped (then it
        goes on at once).

        Only a pause inside a logged section is kept: one between a grant and its ``begin``
        line would make the section look granted after the leases that others took
        meanwhile. Once the worker is stopped its log cannot change, and a last line
        ``begin`` means it is between that line and the section's ``end``.
        """
        process = self.processes[slot]
        if process.poll() is not None:
            return None
        at = time.monotonic()
        process.send_signal(signal.SIGSTOP)
        if not _stopped(process.pid) or not self.in_section(slot):
            process.send_signal(signal.SIGCONT)
            return None
        log = self.logs[slot].name
        self.record(e="pause", pid=process.pid, log=log, t=at, in_section=True)
        self.paused.add(slot)

        def resume() -> None:
            if process.poll() is None:  # the same process: killed meanwhile, it has a code
                self.record(e="resume", pid=process.pid, log=log, t=time.monotonic())
                process.send_signal(signal.SIGCONT)
            self.paused.discard(slot)

        timer = threading.Timer(seconds, resume)
        timer.start()
        return timer

    def stop(self, timeout: float) -> int:
        """Ask every worker to stop after its section; SIGKILL those still running after
        ``timeout`` seconds. Returns how many had to be killed."""
        Path(self.job.stop).touch()
        deadline = time.monotonic() + timeout
        killed = 0
        for slot, process in self.processes.items():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(slot, respawn=False)
                killed += 1
        return killed


def _stopped(pid: int, timeout: float = 1.0) -> bool:
    """Wait until process ``pid`` is stopped (state ``T`` in ``/proc``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        if stat[stat.rindex(b")") + 2 :].startswith(b"T"):
            return True
        time.sleep(0.001)
    return False


class Chaos(threading.Thread):
    """Kills ``faults["kills"]`` workers and pauses ``faults["pauses"]`` workers for
    ``pause`` seconds (each mid-section when it can catch one) at random times, and restarts
    the store ``faults["restarts"]`` times at even intervals (cycling through its restart
    kinds), all within the first 85% of ``duration``; stops by itself, or at ``stop()``."""

    def __init__(
        self,
        fleet: Fleet,
        store: Store,
        faults: dict[str, int],
        duration: float,
        pause: float,
        *,
        seed: int,
    ) -> None:
        super().__init__(name="torture-chaos", daemon=True)
        self.fleet, self.store, self.pause_seconds = fleet, store, pause
        self.random = random.Random(seed)
        restarts = faults.get("restarts", 0) if store.restart_kinds else 0
        plan: list[tuple[float, str]] = []
        for what in ("kill", "pause"):
            plan += [
                (self.random.uniform(0.1, 0.85) * duration, what)
                for _ in range(faults.get(f"{what}s", 0))
            ]
        plan += [((n + 1) / (restarts + 1) * 0.85 * duration, "restart") for n in range(restarts)]
        self.plan = sorted(plan)
        self.done: dict[str, int] = {"kill": 0, "pause": 0, "restart": 0}
        self.errors: list[str] = []
        self.timers: list[threading.Timer] = []
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Stop, and wake every paused worker now."""
        self._stopping.set()
        self.join()
        for timer in self.timers:
            if timer.is_alive():
                timer.cancel()
                timer.function()

    def run(self) -> None:
        began = time.monotonic()
        for at, what in self.plan:
            if self._stopping.wait(max(0.0, began + at - time.monotonic())):
                return
            try:
                if what == "restart":
                    self._restart()
                elif what == "kill":
                    self.fleet.kill(self._victim())
                else:
                    self._pause()
                self.done[what] += 1
            except Exception as exc:  # a failed fault is reported, never fatal to the run
                self.errors.append(f"{what}: {exc!r}")

    def _pause(self) -> None:
        for _ in range(20):
            timer = self.fleet.pause(self._victim(), self.pause_seconds)
            if timer is not None:
                self.timers.append(timer)
                return
        raise RuntimeError("found no worker inside its section to pause")

    def _victim(self) -> int:
        """A worker inside its section, if one is found within about a second; never a
        paused one (its section would end at the pause, not at the kill)."""
        slots = [slot for slot in self.fleet.processes if slot not in self.fleet.paused]
        for _ in range(500):
            slot = self.random.choice(slots)
            if self.fleet.in_section(slot):
                break
            time.sleep(0.002)
        return slot

    def _restart(self) -> None:
        kinds = self.store.restart_kinds
        kind = kinds[self.done["restart"] % len(kinds)]
        at = time.monotonic()
        self.store.restart(kind)
        self.fleet.record(e="restart", kind=kind, t=at, t_end=time.monotonic())
