"""A simulated card gateway. Test cards behave like a real gateway's test numbers:

- ``4242 4242 4242 4242``: approved after ~0.2 s.
- ``4000 0000 0000 0002``: declined the first time it is charged, approved afterwards.
- ``4000 0000 0000 0259``: hangs for 60 s the first time (a gateway that stopped answering),
  approved afterwards. The demo SIGKILLs the worker child stuck on it.

"First time" is remembered in ``DATA/gateway`` so every worker process sees it.
"""

from __future__ import annotations

import json
import os
import time
from decimal import Decimal
from pathlib import Path

__all__ = ["CardDeclined", "pay"]

APPROVED, DECLINED_ONCE, HANGS_ONCE = (
    "4242 4242 4242 4242",
    "4000 0000 0000 0002",
    "4000 0000 0000 0259",
)


class CardDeclined(Exception):
    """The gateway declined the card."""

    def __init__(self, card: str, amount: str) -> None:
        super().__init__(card, amount)
        self.card, self.amount = card, amount

    def __str__(self) -> str:
        return f"card ending {self.card[-4:]} declined for {self.amount}"


def _first_time(data: Path, card: str) -> bool:
    marks = data / "gateway"
    marks.mkdir(exist_ok=True)
    try:
        os.close(os.open(marks / card.replace(" ", ""), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def pay(data: Path, card: str, amount: Decimal, order_id: int) -> str:
    """Charge ``amount`` to ``card``; returns the gateway's reference."""
    if card == DECLINED_ONCE and _first_time(data, card):
        raise CardDeclined(card, str(amount))
    if card == HANGS_ONCE and _first_time(data, card):
        with open(data / "hanging.json", "w") as f:
            json.dump({"order": order_id, "pid": os.getpid()}, f)
        time.sleep(60)
    time.sleep(0.2)
    return f"gw-{order_id}-{int(time.time() * 1000) % 100000}"
