"""The demo's embedded broker: kombu's ``filesystem://`` transport, its message files
written whole.

kombu 5.7 creates a message file under its final name and then writes it. A worker that
lists the folder in between reads an empty message, and its consumer dies of a
``JSONDecodeError`` (seen once in CI: the demo then waited for results no worker would
give). Here a message is written under a name no queue reads (``.part``) and renamed into
place, which is atomic within one file system.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.json import dumps

__all__ = ["SCHEME", "Transport"]

#: The broker URL scheme of this transport.
SCHEME = "dlockfs"


class Channel(filesystem.Channel):  # type: ignore[misc]
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # Names sort by time, as the consumer takes them (kombu's own naming).
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        part = f"{final}.part"
        try:
            with open(part, "wb") as file:
                file.write(dumps(payload).encode())
            os.replace(part, final)
        except OSError as exc:
            if os.path.exists(part):
                os.remove(part)
            raise ChannelError(f"cannot add {final!r} to the queue folder") from exc


class Transport(filesystem.Transport):  # type: ignore[misc]
    Channel = Channel


TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
