"""celery-dlock's tests."""
