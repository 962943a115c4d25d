"""Keys: from a template and a call's arguments to a validated key such as ``job:order:42``.

A template names parameters of the guarded function: ``"order:{order_id}"``, the literal
form ``"order:<order_id>"``, attribute and item access (``{order.id}``, ``{payload[id]}``),
or it is a callable that returns the key. Arguments are bound to the function's signature
with defaults applied, so ``charge(42, 10)`` and ``charge(amount=10, order_id=42)`` give the
same key. Values are written in a canonical text, so equal values give equal keys.
"""

from __future__ import annotations

import datetime as dt
import inspect
import re
import string
import unicodedata
import uuid
from collections.abc import Callable, Mapping
from decimal import Decimal
from enum import Enum
from typing import Any

from celery_dlock.backends.base import MAX_KEY_BYTES
from celery_dlock.errors import ConfigurationError, LockKeyError

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_LIMIT",
    "KeyTemplate",
    "canonical",
    "replacement_name",
    "slot_keys",
    "slot_of",
    "validate_key",
    "validate_limit",
]

#: The most slots a key may have: an attempt on a full key tries each, and each is named
#: up front (``lock_limit=10**9`` built a billion names before its first try).
MAX_LIMIT = 1000

_FORMATTER = string.Formatter()
_LITERAL_PLACEHOLDER = re.compile(r"<([A-Za-z_]\w*(?:\.\w+|\[[^\[\]<>{}]+\])*)>")
_ROOT = re.compile(r"[^.\[]*")


def validate_key(key: str) -> str:
    """Return ``key`` if it is a usable key, else raise :class:`LockKeyError` saying why.

    A key is non-empty, at most :data:`MAX_KEY_BYTES` bytes of UTF-8, and has no control
    characters (they break logs, file names and terminals).
    """
    if not isinstance(key, str):
        raise LockKeyError(f"a lock key must be a str, not {type(key).__name__}: {key!r}")
    if not key:
        raise LockKeyError("the lock key is empty")
    if key.isascii() and key.isprintable() and len(key) <= MAX_KEY_BYTES:
        return key  # the usual key: one byte a character, no control character
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise LockKeyError(f"the lock key {key!r} is not valid Unicode text") from None
    if size > MAX_KEY_BYTES:
        raise LockKeyError(
            f"the lock key is {size} bytes of UTF-8, over the limit of {MAX_KEY_BYTES}: "
            f"{key[:60]!r}..."
        )
    for char in key:
        if unicodedata.category(char) == "Cc" or char in "\u2028\u2029":
            raise LockKeyError(f"the lock key {key!r} contains the control character {char!r}")
    return key


def validate_limit(limit: int) -> int:
    """``limit`` as a count of slots from 1 to :data:`MAX_LIMIT`; a ConfigurationError
    otherwise."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(f"limit must be a whole number >= 1, not {limit!r}")
    if limit > MAX_LIMIT:
        raise ConfigurationError(
            f"limit must be at most {MAX_LIMIT} (slots per key: an attempt on a full key "
            f"tries every one), not {limit}"
        )
    return limit


def slot_of(slot: str, key: str) -> bool:
    """Whether ``slot`` is one of ``key``'s slots (``key#0``, ``key#1``, ...)."""
    return slot.startswith(f"{key}#") and slot[len(key) + 1 :].isdigit()


def slot_keys(key: str, limit: int) -> tuple[str, ...]:
    """The keys a holder of ``key`` with ``limit`` may take: ``key`` itself (1), or its
    slots ``key#0`` .. ``key#<limit-1>``.

    Raises:
        LockKeyError: a slot's key is too long (the limit adds ``#<n>`` to ``key``).
    """
    if limit == 1:
        return (key,)
    try:
        return tuple(validate_key(f"{key}#{n}") for n in range(limit))
    except LockKeyError as exc:
        raise LockKeyError(
            f"with limit={limit} a holder takes one of the slots {key[:40]!r}...#0 .. "
            f"#{limit - 1}, and the suffix makes the key too long: {exc}"
        ) from None


#: Between a lock key and the task's name in the key of a dedupe mark:
#: ``<lock key>#queued:<task name>`` (``celery_dlock.celery.dedupe``).
MARK = "#queued:"


def is_mark(key: str, task_name: str | None) -> bool:
    """Whether ``key``, held for ``task_name``, is a dedupe mark's: not a body lease, nor
    the guard a revoker holds beside a mark (``<mark key>#revoking``)."""
    return task_name is not None and key.endswith(MARK + task_name)


def canonical(value: Any) -> str:
    """The canonical text of a key value; equal values give equal text (``42``,
    ``42.0`` and ``Decimal("42.00")`` all give ``42``).

    Accepted: str, int, bool, None, float, UUID, Decimal, datetime, date, time, Enum (its
    value). Anything else raises :class:`LockKeyError`: a default ``repr`` holds a memory
    address and would make a different key on every call.
    """
    kind = type(value)
    if kind is str:  # the usual values first
        return value  # type: ignore[no-any-return]
    if kind is int:
        try:
            return str(value)
        except ValueError:  # past sys.get_int_max_str_digits() (4300): past a key's length too
            raise _too_long(value) from None
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return canonical(value.value)
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return canonical(int(value))
    if isinstance(value, float):  # 42.0 as 42 and 1e-07 as 0.0000001: as int and Decimal
        return _canonical_decimal(Decimal(repr(value)))
    if isinstance(value, Decimal):
        return _canonical_decimal(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
            return f"{value.isoformat()}Z"
        return str(value.isoformat())
    if isinstance(value, (dt.date, dt.time)):
        return str(value.isoformat())
    raise LockKeyError(
        f"no canonical key text for a value of type {type(value).__qualname__}: "
        "pass a str, int, UUID, Decimal, date, datetime or Enum, or use a callable lock_key"
    )


def _too_long(value: int) -> LockKeyError:
    """The error for an integer too long to print (and past a key's length)."""
    return LockKeyError(
        f"an integer of about {value.bit_length() * 0.30103:.0f} digits is past a key's "
        f"{MAX_KEY_BYTES} bytes"
    )


def _canonical_decimal(value: Decimal) -> str:
    """``value`` in fixed point without trailing zeros, exactly: not ``normalize()``, which
    rounds to the context's 28 digits (two orders of 29 digits would share a key), and
    refused before it is written when it would be past a key's length (``1E+10000000``)."""
    if not value.is_finite():
        return str(value)
    if value.is_zero():
        return "0"
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # finite
    kept = len(digits)
    while digits[kept - 1] == 0:  # not all zero: is_zero() above
        kept -= 1
    exponent += len(digits) - kept
    length = sign + (kept + exponent if exponent >= 0 else max(kept, -exponent + 1) + 1)
    if length > MAX_KEY_BYTES:
        raise LockKeyError(
            f"the decimal value {value:.6E} would take {length} characters in a key, past its "
            f"{MAX_KEY_BYTES} bytes"
        )
    return format(Decimal((sign, digits[:kept], exponent)), "f")


class KeyTemplate:
    """A key template bound to the function whose arguments fill it.

    Args:
        source: the template (``"order:{order_id}"`` or ``"order:<order_id>"``) or a callable
            that gets the call's arguments, bound and with defaults, and returns the key.
        func: the guarded function; its signature is checked now, so a placeholder that is
            not a parameter fails at definition time.
        namespace: prefix joined with ``:`` (``job`` gives ``job:order:42``); ``""`` for none.
        owner: the name used in error messages (the task's name).

    Raises:
        LockKeyError: a placeholder is not a parameter of ``func``, or is positional.
    """

    def __init__(
        self,
        source: str | Callable[..., Any],
        func: Callable[..., Any],
        *,
        namespace: str = "job",
        owner: str | None = None,
    ) -> None:
        self.owner = owner or getattr(func, "__qualname__", repr(func))
        self.namespace = namespace
        self.signature = inspect.signature(func)
        self.callable: Callable[..., Any] | None = None
        self.template = ""
        # The parameters a call can be mapped onto without ``Signature.bind`` (the common
        # case: no *args, **kwargs or keyword-only parameters), with their defaults.
        simple = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in self.signature.parameters.values())
        self._names = tuple(self.signature.parameters) if simple else None
        self._defaults = {
            p.name: p.default
            for p in self.signature.parameters.values()
            if p.default is not p.empty
        }
        #: The ``**kwargs`` parameter, whose entries a template reaches by their own names.
        self._var_keyword = next(
            (p.name for p in self.signature.parameters.values() if p.kind is p.VAR_KEYWORD),
            None,
        )
        self._parts: list[tuple[str, str | None, str | None, str | None]] = []
        if callable(source):
            self.callable = source
        elif isinstance(source, str):
            self.template = _LITERAL_PLACEHOLDER.sub(r"{\1}", source)
            self._check_placeholders(source)
            self._parts = list(_FORMATTER.parse(self.template))
        else:
            raise LockKeyError(
                f"lock_key of {self.owner} must be a str template or a callable, "
                f"not {type(source).__name__}"
            )

    def _check_placeholders(self, source: str) -> None:
        parameters = self.signature.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        try:
            parsed = list(_FORMATTER.parse(self.template))
        except ValueError as exc:
            raise LockKeyError(f"lock_key {source!r} of {self.owner} is malformed: {exc}") from None
        fields = [name for _, name, _, _ in parsed if name is not None]
        for _, name, spec, _ in parsed:
            if spec and "{" in spec:  # str.format would fill it; format() takes it as is
                raise LockKeyError(
                    f"lock_key {source!r} of {self.owner} has a placeholder in the format "
                    f"spec of {{{name}}}: write the spec out, or use a callable lock_key"
                )
        for name in fields:
            root = _ROOT.match(name).group()  # type: ignore[union-attr]  # matches "" at worst
            if not root or root.isdigit():
                raise LockKeyError(
                    f"lock_key {source!r} of {self.owner} has a positional placeholder "
                    f"{{{name}}}: name the parameter instead"
                )
            if root not in parameters and not takes_any:
                known = ", ".join(parameters) or "none"
                raise LockKeyError(
                    f"lock_key {source!r} of {self.owner} uses {root!r}, which is not a "
                    f"parameter of {self.owner} (parameters: {known})"
                )

    def render(self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The full, validated key for one call.

        Raises:
            LockKeyError: an argument is missing, a placeholder cannot be resolved, a value
                has no canonical text, or the key is empty, too long or has control chars.
        """
        arguments = None if self.callable is not None else self._map(args, kwargs or {})
        if arguments is not None:
            body = self._fill(arguments)
        else:
            try:
                bound = self.signature.bind(*args, **(kwargs or {}))
            except TypeError as exc:
                raise LockKeyError(f"cannot build the lock key of {self.owner}: {exc}") from None
            bound.apply_defaults()
            if self.callable is not None:
                value = self.callable(*bound.args, **bound.kwargs)
                body = value if isinstance(value, str) else canonical(value)
            else:
                body = self._fill(bound.arguments)
        key = f"{self.namespace}:{body}" if self.namespace else body
        return validate_key(key)

    def _map(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """The call's arguments by parameter name, as ``Signature.bind`` with defaults would
        give them; None where only ``bind`` can tell (other kinds of parameters, a bad call:
        ``bind`` then names the problem)."""
        names = self._names
        if names is None or len(args) > len(names):
            return None
        arguments = dict(zip(names, args, strict=False))  # fewer args than names: fine
        for name, value in kwargs.items():
            if name in arguments or name not in self.signature.parameters:
                return None
            arguments[name] = value
        if len(arguments) < len(names):
            for name in names:
                if name not in arguments:
                    if name not in self._defaults:
                        return None
                    arguments[name] = self._defaults[name]
        return arguments

    def _fill(self, arguments: Mapping[str, Any]) -> str:
        values = arguments
        if self._var_keyword is not None:
            values = dict(arguments)
            values.update(values.pop(self._var_keyword, {}))
        parts = []
        for literal, name, spec, conversion in self._parts:
            parts.append(literal)
            if name is None:
                continue
            if not spec and not conversion and name in values:  # a plain {name}
                parts.append(canonical(values[name]))
                continue
            try:
                value, _ = _FORMATTER.get_field(name, (), values)
            except (KeyError, AttributeError, IndexError, TypeError) as exc:
                raise LockKeyError(
                    f"cannot build the lock key of {self.owner}: no value for {{{name}}} "
                    f"({type(exc).__name__}: {exc})"
                ) from None
            if conversion:
                value = _FORMATTER.convert_field(value, conversion)
            parts.append(self._formatted(name, value, spec) if spec else canonical(value))
        return "".join(parts)

    def _formatted(self, name: str, value: Any, spec: str) -> str:
        """``value`` in the format ``spec`` of its placeholder ``{name:spec}``."""
        try:
            return format(value, spec)
        except (ValueError, TypeError) as exc:  # "Unknown format code 'd' for ... 'str'"
            raise LockKeyError(
                f"cannot build the lock key of {self.owner}: {{{name}:{spec}}} cannot format "
                f"a value of type {type(value).__qualname__} ({exc})"
            ) from None

    def __repr__(self) -> str:
        source = self.template or repr(self.callable)
        return f"KeyTemplate({source!r}, owner={self.owner!r}, namespace={self.namespace!r})"


def replacement_name(task_name: str, nesting: int) -> str:
    """The task name a ``once`` task's replacement ``nesting`` deep (``Task.replace``, a
    page of a sync) keeps its own success under, on the task's key."""
    return f"{task_name} (replacement {nesting})"
