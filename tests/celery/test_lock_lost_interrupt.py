"""``on_lock_lost="raise"`` leaves nothing behind in the process once the LockLostError is
raised: the next tasks, and a trace or profile function (coverage, a debugger), run as
before it. Found by a test suite that hung: the interrupter cleared the exception it had
set with ``PyThreadState_SetAsyncExc(thread, NULL)``, which on CPython 3.11 leaves the
interpreter's eval breaker set for good; under a profile function the next call of a
Python function then spun at 100% CPU for ever (the xdist worker that had run
``test_on_lock_lost_raise_stops_the_body`` hung in the next soft-limit test it ran).

The task runs in a child process (a hang there is a failure here, not a hang of the suite):
its lease is taken from it while its body runs, the body gets LockLostError, and the same
process then calls Python functions under a profile function, and runs the task again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, time, uuid
    from celery import Celery
    from celery_dlock import LockedTask, Outcome, install
    from celery_dlock.celery.settings import backend_for

    app = Celery("interrupt", set_as_current=False)
    app.conf.update(dlock_backend=f"memory://interrupt-{uuid.uuid4().hex[:8]}")
    install(app, janitor=False)
    store = backend_for(app)

    @app.task(base=LockedTask, shared=False, name="i.doomed", lock_key="doomed:{n}",
              lock_ttl=1.5, on_lock_lost="raise")
    def doomed(n, take_it):
        if not take_it:
            return "ran"
        # The lease is taken away: the next renewal finds it gone and interrupts the body.
        lease = store.get(f"job:doomed:{n}")
        store.release(lease, Outcome.FORCED, "forced", "by the test")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sum(range(100))
        return "finished without noticing"

    result = doomed.apply((1, True)).result
    print("first:", type(result).__name__)

    calls = []
    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    def step(n):
        return n + 1

    sys.setprofile(profile)
    total = sum(step(n) for n in range(100))
    sys.setprofile(None)
    print("profiled:", total, calls.count("step"))
    print("again:", doomed.apply((2, False)).result)
    """
)


def test_a_body_cut_by_lock_lost_leaves_later_profiled_calls_running() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "first: LockLostError", done.stdout
    assert lines[1] == "profiled: 5050 100", done.stdout
    assert lines[2] == "again: ran", done.stdout
