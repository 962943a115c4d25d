"""What a store module (``gcs.py``, ``s3.py``) provides the core: :class:`ObjectStore`.

An adapter reads an object (its body, its version and what the response says about the
server's clock), creates one only if absent, swaps one only if its version is unchanged,
lists names by prefix and deletes. It translates its driver's errors into
:class:`BackendError` in one place, and knows status codes, not messages.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from celery_dlock.errors import BackendError, ConfigurationError

__all__ = [
    "DEFAULT_TTL", "Found", "ObjectStore", "Stamp", "UnsureWrite", "Written", "checked_option",
]  # fmt: skip

#: The ttl of a ``Lock`` given none (the ``ttl`` option): a lease's only liveness here is
#: its ttl, so one without would outlive a killed holder for good.
DEFAULT_TTL = 60.0


def checked_option(backend: str, option: str, value: Any, *, least: float, above: bool) -> Any:
    """``value`` if it is a finite number above ``least`` (``above``) or at least ``least``:
    a bad timeout or attempt count fails here, naming the option, not at the first
    request with the driver's message."""
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or not math.isfinite(number) or number < least or (above and number == least):
        bound = f"above {least:g}" if above else f"at least {least:g}"
        raise ConfigurationError(
            f"option {option!r} of the {backend} backend must be a number {bound}, not {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class Stamp:
    """What one response says about the server's clock.

    Attributes:
        date: the response's ``Date`` header, seconds since the epoch (whole seconds).
        exact: the server time at which this request's write took effect, where the store
            reports it (GCS ``updated``).
    """

    date: float | None
    exact: float | None = None


@dataclass(frozen=True, slots=True)
class Found:
    """A read: the body and version of an object, or None for both if there is none."""

    body: bytes | None
    version: str | None
    stamp: Stamp


@dataclass(frozen=True, slots=True)
class Written:
    """A conditional write: the new version, or None when the precondition failed."""

    version: str | None
    stamp: Stamp


class UnsureWrite(BackendError):
    """A conditional write whose outcome is unknown: the request may have taken effect."""


class ObjectStore(ABC):
    """One bucket as the core uses it. Every method raises :class:`BackendError` (with the
    driver's exception as ``__cause__``) for failures; ``create``/``swap`` raise
    :class:`UnsureWrite` when the write may or may not have happened."""

    @abstractmethod
    def read(self, name: str) -> Found:
        """The object ``name``; a missing one is ``Found(None, None, stamp)``."""

    @abstractmethod
    def create(self, name: str, body: bytes) -> Written:
        """Create ``name`` only if absent (GCS ``ifGenerationMatch=0``, S3 ``If-None-Match``)."""

    @abstractmethod
    def swap(self, name: str, body: bytes, version: str) -> Written:
        """Replace ``name`` only if its version is still ``version``; a missing object or
        another version is ``Written(None, stamp)``."""

    @abstractmethod
    def names(self, prefix: str, start_after: str | None = None) -> Iterator[str]:
        """Names that start with ``prefix`` (after ``start_after``), in byte order."""

    @abstractmethod
    def delete_if(self, name: str, version: str) -> bool:
        """Delete ``name`` only if its version is ``version``; False if it was not."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Delete ``name`` whatever it holds: for history objects only, never a lock."""

    def close(self) -> None:  # noqa: B027 - optional for stores that hold nothing
        """Release connections."""
