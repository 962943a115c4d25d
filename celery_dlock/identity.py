"""Who this process is, and whether a holder's process still exists.

A holder names its process by host, pid, start time and host id (the kernel boot and pid
namespace its pid belongs to): read from ``/proc``, or through psutil where there is none
(macOS, the BSDs; ``CELERY_DLOCK_PORTABLE=1`` forces that on Linux, for testing). A pid
recycled by another process has another start time, so it is never taken for the holder.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

__all__ = [
    "PORTABLE",
    "host_id",
    "identity",
    "pid_exists",
    "portable_forced",
    "portable_identity",
    "process_gone",
    "process_start",
    "process_state",
]


#: The largest pid a process can have (``pid_t`` is a C int): ``os.kill`` raises
#: ``OverflowError`` past it.
_PID_MAX = 2**31 - 1


@lru_cache(maxsize=1)
def _ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")


def process_start(pid: int) -> float | None:
    """The start time of process ``pid`` in seconds since boot, or None if there is no such
    live process (none at all, a zombie, or no ``/proc``).

    Seconds since boot, not since the epoch: ``/proc/stat``'s boot time moves when the wall
    clock is stepped, which would make a live process look like a recycled pid.
    """
    state = process_state(pid)
    return None if state is None or state[0] in "ZX" else state[1]


def process_state(pid: int) -> tuple[str, float] | None:
    """``(state letter, start in seconds since boot)`` of ``pid`` from ``/proc``, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields count from the end of the command name, which may itself hold spaces or ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19]) / _ticks_per_second()


@lru_cache(maxsize=1)
def host_id() -> str:
    """Which kernel boot and pid namespace our pids belong to ('' where unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{namespace}"


#: ``host_id`` prefix of a holder identified through psutil, where there is no ``/proc``
#: (macOS, the BSDs; the file store's ``portable`` mode).
PORTABLE = "psutil:"
#: Seconds by which a live process's start time, read through psutil, may differ between
#: two reads (its clock ticks): beyond this the pid belongs to another process.
_START_TOLERANCE = 1.0


@lru_cache(maxsize=1)
def _portable_host_id() -> str:
    """This host and boot through psutil (a wall clock stepped by a second or more changes
    it, and holders then read as another host's: never judged gone); '' without psutil."""
    try:
        import psutil  # optional: for the file store without /proc
    except ImportError:
        return ""
    return f"{PORTABLE}{socket.gethostname()}/{int(psutil.boot_time())}"


def portable_identity(pid: int) -> tuple[float | None, str]:
    """``(start time, host id)`` of process ``pid`` through psutil, for the file store's
    portable mode; ``(None, "")`` (a holder never judged gone) without psutil."""
    host_id = _portable_host_id()
    if not host_id:
        return None, ""
    import psutil

    try:
        return psutil.Process(pid).create_time(), host_id
    except psutil.Error:
        return None, host_id


def _portable_gone(pid: int, started: float | None, host: str) -> bool:
    if host != _portable_host_id():
        return False
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        now_started = process.create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False  # cannot tell: alive
    return started is not None and abs(now_started - started) > _START_TOLERANCE


def process_gone(pid: int, started: float | None, host: str) -> bool:
    """True only when process ``pid``, started at ``started`` on the host (kernel boot and
    pid namespace, see :func:`host_id`) ``host``, provably no longer exists.

    That needs the same kernel and pid namespace as ours; then the pid must be free or
    belong to a process with another start time. Anything we cannot check is alive, and
    so is a pid no process can have (the store's entries are written by any client: a
    corrupt one, another language's).
    """
    if type(pid) is not int or not 0 < pid <= _PID_MAX:
        return False
    if host.startswith(PORTABLE):
        return _portable_gone(pid, started, host)
    if not host or host != host_id():
        return False
    state = process_state(pid)
    if state is None:
        return not pid_exists(pid)
    letter, now_started = state
    if letter in "ZX":  # dead, only waiting for its parent to collect it
        return True
    return started is not None and now_started != started


@lru_cache(maxsize=4)
def identity(pid: int) -> tuple[str, float | None, str]:
    """Host name, start time and host id of our own process (cached per pid: forks differ):
    from /proc, or through psutil where there is none (or ``CELERY_DLOCK_PORTABLE=1``)."""
    host = "" if portable_forced() else host_id()
    if host:
        return socket.gethostname(), process_start(pid), host
    started, host = portable_identity(pid)
    return socket.gethostname(), started, host


def portable_forced() -> bool:
    """``CELERY_DLOCK_PORTABLE=1``: behave as where there is no /proc, inotify or pidfd (for
    testing the portable path on Linux)."""
    return os.environ.get("CELERY_DLOCK_PORTABLE") == "1"


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
