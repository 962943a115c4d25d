"""The arguments a retry is sent with, as Celery 5.7 merges them.

``self.retry(kwargs=...)`` of a task called with positional arguments (or ``args=`` of one
called with keywords) keeps the inherited values the new ones do not replace
(celery/celery#6494, fixed in 5.7): ``charge.delay(42, 0)`` then
``retry(kwargs={"order_id": 42, "attempt": 1})`` runs ``charge(42, attempt=1)``. The lease
kept for a retry must be judged by the key of those arguments. Before 5.7 Celery sent both
and rejected the retry itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["retry_arguments"]


def retry_arguments(
    run: Callable[..., Any],
    inherited: tuple[tuple[Any, ...], dict[str, Any]],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any] | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``(args, kwargs)`` of the retry of a call made with ``inherited``, given the
    retry's own ``args`` and ``kwargs`` (None: the inherited ones)."""
    old_args, old_kwargs = inherited
    new_args = old_args if args is None else tuple(args)
    new_kwargs = old_kwargs if kwargs is None else dict(kwargs)
    if (args is None) == (kwargs is None) or not (old_kwargs if kwargs is None else old_args):
        return new_args, new_kwargs
    try:
        signature = inspect.signature(run)
    except (TypeError, ValueError):
        return new_args, new_kwargs
    if args is not None:  # new positional values: the keywords they cover go
        positional = [
            p
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        covered = {p.name for p in positional[: len(new_args)] if p.kind is p.POSITIONAL_OR_KEYWORD}
        return new_args, {k: v for k, v in old_kwargs.items() if k not in covered}
    try:  # new keywords: an inherited positional value of that name is replaced
        bound = signature.bind_partial(*old_args)
    except TypeError:
        return new_args, new_kwargs
    rest = dict(new_kwargs)
    for name in list(rest):
        parameter = signature.parameters.get(name)
        if (
            name in bound.arguments
            and parameter
            and parameter.kind is parameter.POSITIONAL_OR_KEYWORD
        ):
            bound.arguments[name] = rest.pop(name)
    return tuple(bound.args), {**bound.kwargs, **rest}
