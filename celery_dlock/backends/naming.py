"""Safe, unique file and object names for keys, shared by the file and object-store backends.

A name is the key percent-encoded (only ``A-Z a-z 0-9 _ : -`` stay), so ``/``, ``..`` and
``%`` cannot escape a directory or collide; a name over 200 bytes keeps a prefix and adds
the key's SHA-256.
"""

from __future__ import annotations

import hashlib

__all__ = ["file_name"]

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_:-")
_NAME_LIMIT = 200


def file_name(text: str) -> str:
    """A file name for ``text`` that is safe and unique: percent-encoded, or for long
    text a prefix, ``~`` (which encoding never produces) and the SHA-256 of the text."""
    raw = text.encode("utf-8")
    name = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(name) <= _NAME_LIMIT:
        return name
    return f"{name[:120]}~{hashlib.sha256(raw).hexdigest()}"
