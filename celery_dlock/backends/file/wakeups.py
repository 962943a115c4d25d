"""Kernel wakeups for ``FileBackend.wait``: inotify on the keys' files, a pidfd on each
holder's process."""

from __future__ import annotations

import ctypes
import os
from typing import Any, ClassVar

from celery_dlock.records import Holder


class Inotify:
    """inotify through libc, for a kernel wakeup when a lock file changes."""

    # The libc handle is loaded once; a forked child keeps using it (a dlopen handle is
    # process memory, not a descriptor). Each watch is its own descriptor, closed by the waiter.
    _libc: ClassVar[Any] = None
    # IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_DELETE_SELF
    _MASK = 0x002 | 0x004 | 0x008 | 0x400

    @classmethod
    def watch(cls, *paths: str) -> int | None:
        """One inotify fd watching every one of ``paths``, or None where inotify cannot be
        had (not Linux, a file is gone, the watch limit is reached): the caller then polls."""
        if cls._libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            cls._libc = libc if hasattr(libc, "inotify_init1") else False
        if cls._libc is False:
            return None
        fd = int(cls._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            return None
        for path in paths:
            if cls._libc.inotify_add_watch(fd, os.fsencode(path), cls._MASK) < 0:
                os.close(fd)
                return None
        return fd


def watch_holder(holder: Holder) -> int | None:
    """A pidfd that becomes readable when ``holder``'s process exits, if it runs here."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None or holder.is_gone() or holder.host_id == "":
        return None
    try:
        fd: int = pidfd_open(holder.pid)
    except OSError:
        return None
    if holder.is_gone():  # the pid was recycled between the check and the open
        os.close(fd)
        return None
    return fd
