"""``serve``: the web page over the lock store (``pip install 'celery-dlock[web]'``).

Flask for the page (a maintained, small, synchronous framework: the stores' clients are
synchronous too) and waitress to serve it (a pure-Python production WSGI server, no C
build, on every OS). Binds to 127.0.0.1 unless told otherwise; read-only unless
``--allow-release``, which needs a secret in ``DLOCK_RELEASE_SECRET`` (typed into the page
to release, never printed).
"""

from __future__ import annotations

import errno
import os
from typing import Any

import click

from celery_dlock.cli.env import Env, UsageFailure, guarded

__all__ = ["serve"]

#: The environment variable that holds the secret an operator types to release a lease.
SECRET_VARIABLE = "DLOCK_RELEASE_SECRET"


@click.command()
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True)
@click.option("--bind", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option(
    "--allow-release",
    is_flag=True,
    help=f"Let the page release a lease (recorded forced, with who and why); needs the secret "
    f"in ${SECRET_VARIABLE}.",
)
@guarded
def serve(env: Env, *, port: int, bind: str, allow_release: bool) -> None:
    """Serve a page of the store's leases, history and timeline, and /metrics.

    Read-only unless --allow-release. Stop it with Ctrl-C.
    """
    secret = None
    if allow_release:
        secret = os.environ.get(SECRET_VARIABLE, "")
        if len(secret) < 12:
            raise UsageFailure(
                f"--allow-release needs a secret of 12 characters or more in ${SECRET_VARIABLE}"
            )
    try:
        import waitress  # the [web] extra

        from celery_dlock.cli.web import make_app
    except ImportError as exc:
        raise UsageFailure(
            f"serve needs the [web] extra: pip install 'celery-dlock[web]' ({exc})"
        ) from None
    app = make_app(env.backend, prefix=env.target.prefix, release_secret=secret)
    try:  # bound here, before a word is printed: the line below names the real port
        server = waitress.create_server(app, host=bind, port=port, threads=4, ident="celery-dlock")
    except OSError as exc:
        raise click.ClickException(_bind_failure(bind, port, exc)) from None
    mode = "releasing allowed" if secret else "read-only"
    for host, bound in _listening(server):
        shown = f"[{host}]" if ":" in host else host
        env.echo(f"serving {env.url} on http://{shown}:{bound}/ ({mode}); Ctrl-C stops")
    try:
        server.run()
    except KeyboardInterrupt:  # how it is meant to stop
        pass
    finally:
        server.close()


def _listening(server: Any) -> list[tuple[str, int]]:
    """The (host, port) pairs ``server`` listens on: one per address ``--bind`` named."""
    many = getattr(server, "effective_listen", None)
    return list(many) if many else [(server.effective_host, server.effective_port)]


def _bind_failure(bind: str, port: int, exc: OSError) -> str:
    where = f"{bind}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"cannot listen on {where}: the port is in use (choose another with --port)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {bind} is not an address of this machine (--bind)"
    if exc.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied (ports below 1024 need privileges)"
    return f"cannot listen on {where}: {exc.strerror or exc}"
