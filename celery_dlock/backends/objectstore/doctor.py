"""``celery dlock doctor`` for object stores: does the bucket honour what the locks rest on?

An S3-compatible store that ignores ``If-None-Match``/``If-Match`` (some do) gives no mutual
exclusion at all, and one that ignores conditional deletes (fake-gcs-server, measured) makes
the janitor's collect unsafe. The checks write one object under ``doctor/`` and
delete it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_dlock.backends.base import Check
from celery_dlock.backends.objectstore.clock import CALIBRATED
from celery_dlock.backends.objectstore.layout import encode
from celery_dlock.records import new_token

if TYPE_CHECKING:
    from celery_dlock.backends.objectstore import ObjectStoreBackend

__all__ = ["checks"]


def checks(backend: ObjectStoreBackend) -> list[Check]:
    """Create-if-absent, compare-and-swap and conditional delete, tried on a scratch
    object; and how narrowly the server's clock is known."""
    store = backend.store()
    name = f"{backend.layout.doctor}{new_token()}"
    found: list[Check] = []
    first = store.create(name, encode({"doctor": new_token()}))
    second = store.create(name, encode({"doctor": new_token()}))
    found.append(
        Check(
            "create-if-absent",
            first.version is not None and second.version is None,
            "a second create of the same object was refused"
            if second.version is None
            else "a second create of the same object SUCCEEDED: no mutual exclusion here",
        )
    )
    stale = str(first.version)
    swapped = store.swap(name, encode({"doctor": 1}), stale)
    refused = store.swap(name, encode({"doctor": 2}), stale)
    found.append(
        Check(
            "compare-and-swap",
            swapped.version is not None and refused.version is None,
            "a swap on a stale version was refused"
            if refused.version is None
            else "a swap on a stale version SUCCEEDED: no mutual exclusion here",
        )
    )
    kept = not store.delete_if(name, stale) and store.read(name).body is not None
    found.append(
        Check(
            "conditional delete",
            kept,
            "a delete on a stale version was refused"
            if kept
            else "a delete on a stale version went through: the janitor's collect "
            "could delete a lock object taken meanwhile; set gc_after very high here",
        )
    )
    store.delete(name)
    backend.objects.calibrate()
    uncertainty = backend.server_clock.uncertainty
    found.append(
        Check(
            "server clock",
            uncertainty <= CALIBRATED,
            f"known within {uncertainty * 1000:.0f} ms from the Date of its responses",
        )
    )
    return found
