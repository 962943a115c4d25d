"""A simulated card gateway. Test cards behave like a real gateway's test numbers:

- ``4242 4242 4242 4242``: approved after ~0.2 s.
- ``4000 0000 0000 0002``: declined the first time it is charged, approved afterwards.
- ``4000 0000 0000 0259``: hangs for 60 s the first time (a gateway that stopped answering),
  approved afterwards. The demo SIGKILLs the worker child stuck on it.

"First time" is remembered in ``DATA/gateway`` so every worker process sees it.

Like a real gateway (Stripe's ``Idempotency-Key``), it honours an idempotency key: a second
request with a key it has seen moves no money and answers with the first request's
reference. Every charge that moved money is a line in ``DATA/gateway/charges.jsonl``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from decimal import Decimal
from pathlib import Path

__all__ = ["CardDeclined", "GatewayBusy", "charges", "pay"]

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


class GatewayBusy(Exception):
    """A request with this idempotency key is still being processed (HTTP 409): retry."""

    def __init__(self, idempotency_key: str) -> None:
        super().__init__(idempotency_key)
        self.idempotency_key = idempotency_key

    def __str__(self) -> str:
        return f"a request with idempotency key {self.idempotency_key} is in progress"


def _first_time(data: Path, card: str) -> bool:
    marks = data / "gateway"
    marks.mkdir(exist_ok=True)
    try:
        os.close(os.open(marks / card.replace(" ", ""), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def pay(
    data: Path, card: str, amount: Decimal, order_id: int, idempotency_key: str | None = None
) -> str:
    """Charge ``amount`` to ``card``; returns the gateway's reference. A request whose
    ``idempotency_key`` was seen before moves no money and returns the first reference."""
    if idempotency_key is None:
        return _charge(data, card, amount, order_id)
    keys = data / "gateway" / "idempotency"
    keys.mkdir(parents=True, exist_ok=True)
    # The key's file holds the reference once charged; while a request runs it holds an
    # flock, which dies with its process (a request cut short charged nothing here).
    fd = os.open(keys / idempotency_key, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GatewayBusy(idempotency_key) from None
        seen = os.read(fd, 256).decode()
        if seen:
            return seen
        reference = _charge(data, card, amount, order_id)
        os.write(fd, reference.encode())
        return reference
    finally:
        os.close(fd)


def charges(data: Path) -> list[dict[str, object]]:
    """Every charge that moved money, in order."""
    path = data / "gateway" / "charges.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _charge(data: Path, card: str, amount: Decimal, order_id: int) -> str:
    if card == DECLINED_ONCE and _first_time(data, card):
        raise CardDeclined(card, str(amount))
    if card == HANGS_ONCE and _first_time(data, card):
        with open(data / "hanging.json", "w") as f:
            json.dump({"order": order_id, "pid": os.getpid()}, f)
        time.sleep(60)
    time.sleep(0.2)
    reference = f"gw-{order_id}-{os.urandom(4).hex()}"
    (data / "gateway").mkdir(exist_ok=True)
    with open(data / "gateway" / "charges.jsonl", "a") as f:
        f.write(json.dumps({"order": order_id, "amount": str(amount), "reference": reference}))
        f.write("\n")
    return reference
