"""``python -m celery_dlock.cli``: the ``celery-dlock`` command, where its entry point is
not on the ``PATH`` (a virtualenv not activated, a container's bare ``python``)."""

from celery_dlock.cli import main

main(prog_name="celery-dlock")
