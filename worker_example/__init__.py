"""A small payments app guarded by celery-dlock: see README.md, "The demo"."""
