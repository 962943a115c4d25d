"""``serve``: the web page over the lock store (``pip install 'celery-dlock[web]'``).

Flask for the page (a maintained, small, synchronous framework: the stores' clients are
synchronous too) and waitress to serve it (a pure-Python production WSGI server, no C
build, on every OS). Binds to 127.0.0.1 unless told otherwise; read-only unless
``--allow-release``, which needs a secret in ``DLOCK_RELEASE_SECRET`` (typed into the page
to release, never printed).
"""

from __future__ import annotations

import os

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
    mode = "releasing allowed" if secret else "read-only"
    env.echo(f"serving {env.url} on http://{bind}:{port}/ ({mode}); Ctrl-C stops")
    waitress.serve(app, host=bind, port=port, threads=4, ident="celery-dlock")
