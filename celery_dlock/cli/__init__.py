"""The command line: ``celery -A proj dlock ...`` and the standalone ``celery-dlock``.

Usage::

    celery -A proj dlock leases                  # the app's dlock_backend and dlock_namespace
    celery -A proj dlock --backend URL history --problems --since 1h
    celery-dlock --backend postgresql://... doctor
    DLOCK_BACKEND=redis://cache:6379/1 celery-dlock release job:order:42 --reason "stuck"

Commands (the same in both): ``leases [PREFIX]``, ``history [KEY]``, ``release KEY``, ``forget KEY
--task NAME`` (what ``once`` keeps: see :mod:`celery_dlock.cli.forget`), ``reap``,
``migrate``, ``doctor``, ``timeline -o FILE.svg`` (a picture of the leases: see
:mod:`celery_dlock.cli.timeline`), each of which takes ``--json``; ``run KEY -- COMMAND`` (a
command under the lock, for cron: see :mod:`celery_dlock.cli.run`) and ``serve`` (a web page
over the store: see :mod:`celery_dlock.cli.serve`), whose output is the command's and a
page. ``dlock`` is the ``celery.commands`` entry
point and reads the app's settings through ``ctx.obj.app``; ``main`` needs no app (nor
Celery installed) and takes the store from ``--backend`` or ``DLOCK_BACKEND``.

Keys are given in full, exactly as ``leases`` prints them. Passwords in URLs are masked in
every line printed, error messages included. Exit codes: 0 done, 1 failed (store
unreachable, a doctor check failed, nothing released), 2 bad usage or configuration, 130
after Ctrl-C, 141 (128 + SIGPIPE, as for ``cat``) when the reader of the output went away
(``| head``), quietly.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from celery_dlock.cli.commands import COMMANDS
from celery_dlock.cli.doctor import doctor
from celery_dlock.cli.env import Env, Target, UsageFailure
from celery_dlock.cli.forget import forget
from celery_dlock.cli.janitor import migrate, reap
from celery_dlock.cli.marks import marks
from celery_dlock.cli.run import run
from celery_dlock.cli.serve import serve
from celery_dlock.cli.timeline import timeline

__all__ = ["dlock", "main"]

_BACKEND_HELP = "The lock store's URL"


def _drop(record: logging.LogRecord) -> bool:
    return False


@click.group(name="dlock")
@click.option(
    "--backend",
    "backend_url",
    metavar="URL",
    help=f"{_BACKEND_HELP} (default: the app's dlock_backend).",
)
@click.option("--namespace", help="The key namespace (default: the app's dlock_namespace).")
@click.pass_context
def dlock(
    ctx: click.Context, /, backend_url: str | None, namespace: str | None, **_preload: Any
) -> None:
    """Inspect and manage celery-dlock locks: leases, history, release, forget, reap, migrate,
    doctor, run, timeline, serve."""
    # Celery < 5.7 passes the app's preload options to plugin commands: hence **_preload.
    app = getattr(ctx.obj, "app", None)
    if app is None:
        raise click.UsageError(
            "`dlock` runs as `celery -A proj dlock`; "
            "without an app use `celery-dlock --backend URL`"
        )

    def resolve() -> Target:
        from celery_dlock.celery.settings import settings

        if backend_url is None:
            current = settings(app)
        else:
            # settings() warns that the default file store is used when dlock_backend is
            # unset: not so here, --backend replaces it.
            quiet = logging.getLogger("celery_dlock")
            quiet.addFilter(_drop)
            try:
                current = settings(app)
            finally:
                quiet.removeFilter(_drop)
        if backend_url is not None:
            url, source = backend_url, "--backend"
        elif app.conf.get("dlock_backend") is not None:
            url, source = current.backend, "dlock_backend"
        else:
            url, source = current.backend, "the default file store: dlock_backend is not set"
        return Target(
            url=url,
            source=source,
            namespace=current.namespace if namespace is None else namespace,
            janitor_interval=current.janitor_interval,
            retention=current.history_retention,
        )

    ctx.obj = Env(resolve)


@click.group(name="celery-dlock")
@click.option(
    "--backend",
    "backend_url",
    metavar="URL",
    envvar="DLOCK_BACKEND",
    help=f"{_BACKEND_HELP} [env: DLOCK_BACKEND].",
)
@click.option(
    "--namespace",
    default="job",
    show_default=True,
    envvar="DLOCK_NAMESPACE",
    help="The key namespace [env: DLOCK_NAMESPACE].",
)
@click.version_option(package_name="celery-dlock", prog_name="celery-dlock")
@click.pass_context
def main(ctx: click.Context, /, backend_url: str | None, namespace: str) -> None:
    """Inspect and manage celery-dlock locks without a Celery app."""
    from_env = ctx.get_parameter_source("backend_url") is click.core.ParameterSource.ENVIRONMENT

    def resolve() -> Target:
        if not backend_url:
            raise UsageFailure("no lock store: pass --backend URL or set DLOCK_BACKEND")
        return Target(
            url=backend_url,
            source="DLOCK_BACKEND" if from_env else "--backend",
            namespace=namespace,
        )

    ctx.obj = Env(resolve)


for _command in (*COMMANDS, marks, forget, reap, migrate, doctor, run, timeline, serve):
    dlock.add_command(_command)
    main.add_command(_command)
