"""Lease tokens, drawn from ``os.urandom`` a batch at a time (``records.new_token``).

A token is 128 random bits as hex; one ``getrandom`` fills 256 of them (an acquire of the
file store makes some ten system calls: one more per token was a tenth of its cost). Each
token is taken once: ``deque.popleft`` is atomic, and a forked child drops the batch it
inherited, since its parent takes those very tokens.
"""

from __future__ import annotations

import os
from collections import deque

__all__ = ["new_token"]

_BATCH = 256
_pool: deque[str] = deque()


def new_token() -> str:
    """A fresh random token: 128 bits, hex, never handed out twice in any process."""
    while True:
        try:
            return _pool.popleft()
        except IndexError:
            data = os.urandom(16 * _BATCH).hex()
            _pool.extend(data[i : i + 32] for i in range(0, len(data), 32))


os.register_at_fork(after_in_child=_pool.clear)
