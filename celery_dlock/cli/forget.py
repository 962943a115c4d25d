"""``forget KEY --task NAME``: an operator undoes what ``once`` keeps, so that the next run of
that task on that key runs its body again (a charge refunded and due again, a success that
was wrong), through :func:`celery_dlock.forgetting.forget`.

The success shown, and asked about, is the one forgotten (by its lease's token): a success
kept since by another run is left alone.
"""

from __future__ import annotations

import json
import time
from typing import Any, NoReturn

import click

from celery_dlock.cli.commands import JSON, confirmed, operator
from celery_dlock.cli.env import Env, guarded
from celery_dlock.cli.render import holder_text, human_duration, local_time, record_json
from celery_dlock.errors import LockKeyError
from celery_dlock.forgetting import forget as forget_kept
from celery_dlock.forgetting import kept_steps
from celery_dlock.keys import MARK, validate_key
from celery_dlock.records import Record

__all__ = ["forget"]

#: Characters of the kept result shown before the question (``--json`` has all of it).
RESULT_SHOWN = 200


@click.command()
@click.argument("key")
@click.option(
    "--task",
    "task_name",
    required=True,
    help="The task whose success is forgotten, by its Celery name (as `history` shows it).",
)
@click.option("--force", is_flag=True, help="Do not ask for confirmation.")
@click.option("--reason", default="no reason given", show_default=True, help="Kept in the record.")
@JSON
@guarded
def forget(env: Env, key: str, *, task_name: str, force: bool, reason: str, as_json: bool) -> None:
    """Forget the success that `once` keeps for TASK on KEY, recorded as forgotten.

    KEY is the full key, as `history` shows it. Shows the kept success and asks first,
    unless --force. The next run of the task on the key runs its body instead of returning
    that result. Only the success shown is forgotten: one kept since by another run is left
    alone. Exit code 0 only when this command forgot it.
    """
    validate_key(key)
    if not task_name.strip():
        raise click.BadParameter("must name a task", param_hint="--task")
    backend = env.backend
    kept = backend.last_success(key, task_name)
    if kept is None:
        text = f"no success of {task_name} is kept on {key!r}{_hint(env, key, task_name)}"
        _finish(env, as_json, key, "not_kept", text)
    steps = kept_steps(backend, key, task_name)
    env.echo(f"success kept on {key} for {task_name}:\n{_lines(kept)}", err=as_json)
    if steps:
        env.echo(f"  and the successes of its replacements: {', '.join(steps)}", err=as_json)
    for note in _going_on(env, key, task_name):
        env.echo(note, err=as_json)
    question = "Forget it, so that the next run runs its body again?"
    if not force and not confirmed(env, question, err=as_json):
        _finish(env, as_json, key, "declined", "not forgotten", kept=kept)
    by = f"{operator()} with celery-dlock forget"
    record = forget_kept(backend, key, task_name, reason=reason, by=by, token=kept.lease.token)
    if record is None:
        text = (
            f"not forgotten: the success of {task_name} on {key} changed meanwhile (forgotten "
            "by someone else, or kept by another run); nothing was touched"
        )
        _finish(env, as_json, key, "changed", text, kept=kept)
    # What the record says was forgotten, not ``steps``: a page of the run that kept
    # the success may have kept its own while the question was asked, and went with it.
    text = f"forgot the success of {task_name} on {key} (fence {kept.fence}): {record.details}"
    _finish(env, as_json, key, "forgotten", text, kept=kept, record=record)


def _hint(env: Env, key: str, task_name: str) -> str:
    """What to try instead: the key in full, when it lacks the namespace and the full key
    keeps a success of the task."""
    prefix = env.target.prefix
    full = prefix + key
    if prefix and not key.startswith(prefix) and env.backend.last_success(full, task_name):
        return f" (keys are given in full: did you mean {full!r}?)"
    return ": nothing to forget"


def _going_on(env: Env, key: str, task_name: str) -> list[str]:
    """What will run the task on the key whatever is forgotten now: a run holding the key
    (its success, if it ends after this, is the one kept and replayed) and a message
    queued under a dedupe mark (its body runs). An operator who forgets so that the next
    run charges anew must know that the next run may already be going on."""
    notes = []
    held = env.backend.get(key)
    if held is not None:
        notes.append(
            f"  note: a run holds {key} now (fence {held.fence}, {holder_text(held)}): if it "
            "succeeds after this, its success is kept and replayed"
        )
    mark_key = f"{key}{MARK}{task_name}"
    try:
        mark = env.backend.get(validate_key(mark_key))
    except LockKeyError:  # too long to be a mark's key: no message was marked with it
        mark = None
    if mark is not None:
        notes.append(
            f"  note: a message of {task_name} is queued for {key} ({holder_text(mark)}): "
            "it runs its body after this"
        )
    return notes


def _lines(kept: Record) -> str:
    """The kept success as indented ``name value`` lines, for a person about to forget it."""
    result = json.dumps(kept.result, default=str, ensure_ascii=False)
    if len(result) > RESULT_SHOWN:
        result = f"{result[:RESULT_SHOWN]}… ({len(result)} characters)"
    ago = human_duration(time.time() - kept.released_at)
    rows = [
        ["fence", str(kept.fence)],
        ["task id", str(kept.lease.holder.task_id)],
        ["holder", kept.lease.holder.describe()],
        ["released", f"{local_time(kept.released_at)} ({ago} ago)"],
        ["result", result],
    ]
    return "\n".join(f"  {name:<9}{value}" for name, value in rows)


def _finish(
    env: Env,
    as_json: bool,
    key: str,
    status: str,
    text: str,
    *,
    kept: Record | None = None,
    record: Record | None = None,
) -> NoReturn:
    """Report how ``forget`` ended and exit: 0 when forgotten, else 1."""
    forgotten = status == "forgotten"
    if as_json:
        data: dict[str, Any] = {
            "backend": env.url,
            "key": key,
            "status": status,
            "forgotten": forgotten,
            "kept": None if kept is None else record_json(kept),
            "record": None if record is None else record_json(record),
        }
        env.emit_json(data)
    else:
        env.echo(text, err=not forgotten)
    click.get_current_context().exit(0 if forgotten else 1)
