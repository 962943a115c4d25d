"""An asyncio waiter's place in the queue of a key: the waiter connection whose wait
returned, from the loop's ``wait`` until it is left or used up (see the blocking
``Queued``). Left by a task of the event loop, or, by an acquire that gives up (a timeout,
an error, a cancel), before that is raised: a task of a loop that ends right after
(``asyncio.run`` returning) may be cut or never run, and the place then stayed held until
the server saw the connection closed, refusing the next try of the key by anyone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg

from celery_dlock.backends.base import Place

#: The loop's ``end_wait``: the connection leaves the queue and goes back to the loop's idle
#: waiters (closed if that fails).
EndWait = Callable[[psycopg.AsyncConnection[Any]], Coroutine[Any, Any, None]]

__all__ = ["AsyncPlace", "EndWait"]

_tasks: set[asyncio.Task[None]] = set()


class AsyncPlace(Place):
    """A waiter connection of a loop in the queue of ``key``."""

    __slots__ = ("_end_wait", "conn", "key", "left")

    def __init__(self, key: str, conn: psycopg.AsyncConnection[Any], end_wait: EndWait) -> None:
        self.key = key
        self.conn = conn
        self._end_wait = end_wait
        self.left = False

    @property
    def held(self) -> bool:
        return not self.left

    def leave(self) -> None:
        if not self.left:
            self.left = True
            task = asyncio.get_running_loop().create_task(self._end_wait(self.conn))
            _tasks.add(task)  # kept until done: the loop holds tasks only weakly
            task.add_done_callback(_tasks.discard)

    async def leave_now(self) -> None:
        """Leave, and return once the server has let the next waiter in (or, if that fails,
        once the connection is closed, which the server sees a moment later)."""
        if not self.left:
            self.left = True
            await self._end_wait(self.conn)
