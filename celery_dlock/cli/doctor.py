"""``doctor``: is the lock store reachable and healthy, and is the janitor running?

Checks, in order: connect (a ``get`` of a probe key), capabilities, clock skew (the store's
clock against ours: warn past 1 s, fail past 30 s), the backend's own ``diagnose()``
findings (schema, pooler mode...), and the janitor's last run (the newest record of its
own lock key). Exit code 0 when nothing failed (warnings allowed), else 1.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Literal

import click

from celery_dlock.backends.base import Diagnosable, server_time
from celery_dlock.backends.common import store_now
from celery_dlock.cli.commands import JSON
from celery_dlock.cli.env import Env, failure_text, guarded
from celery_dlock.cli.render import DURATION, human_duration, local_time, table
from celery_dlock.reap import JANITOR_QUIET, janitor_key
from celery_dlock.records import Outcome

__all__ = ["SKEW_FAIL", "SKEW_WARN", "Finding", "doctor"]

#: Clock skew (seconds) past which the doctor warns, and fails.
SKEW_WARN = 1.0
SKEW_FAIL = 30.0
#: The janitor is late when its last recorded run is older than this many intervals past
#: the hour (``JANITOR_QUIET``) in which a run with nothing to do goes unrecorded.
JANITOR_LATE = 3
#: Seconds after which a failed connect is taken for a store that did not answer (the
#: drivers' connect timeouts: 10 s for Postgres, 15 s for Redis): its own checks, which
#: would only wait as long again, are not run.
NO_ANSWER = 5.0

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One line of the doctor's report."""

    name: str
    status: Status
    detail: str


def _connect(env: Env) -> tuple[Finding, bool]:
    """The connect check, and whether the store answered (if only with an error)."""
    probe = f"{env.target.prefix}celery_dlock.doctor"
    started = time.monotonic()
    try:
        env.backend.get(probe)
    except Exception as exc:
        waited = time.monotonic() - started
        if waited < NO_ANSWER:
            return Finding("connect", "fail", failure_text(exc)), True
        note = f" (no answer in {human_duration(waited)}: the store's own checks not run)"
        return Finding("connect", "fail", failure_text(exc) + note), False
    took = human_duration(time.monotonic() - started)
    return Finding("connect", "ok", f"get({probe!r}) answered in {took}"), True


def _capabilities(env: Env) -> Finding:
    caps = env.backend.capabilities
    liveness = {
        "session": "a holder is alive while its connection is",
        "process": "a holder is alive while its process is",
        "lease": "a holder is alive while it renews before expiry",
    }[caps.liveness]
    parts = [
        f"liveness {caps.liveness} ({liveness})",
        "push wakeups" if caps.push_wait else "polled wakeups",
        "shared across hosts" if caps.cross_host else "shared by this host only",
        "durable history" if caps.durable_history else "history as durable as the store",
        "store's clock" if caps.server_clock else "callers' clocks",
    ]
    if not caps.cross_process:
        detail = "a store private to one process: the CLI sees only its own, empty store"
        return Finding("capabilities", "warn", f"{detail}; {'; '.join(parts)}")
    return Finding("capabilities", "ok", "; ".join(parts))


def _clock_skew(env: Env) -> Finding:
    before = time.time()
    server = server_time(env.backend)
    after = time.time()
    if server is None:
        return Finding("clock skew", "ok", "n/a (this backend reports no clock of its own)")
    skew = server - (before + after) / 2
    status: Status = "ok"
    if abs(skew) > SKEW_FAIL:
        status = "fail"
    elif abs(skew) > SKEW_WARN:
        status = "warn"
    side = "ahead of" if skew > 0 else "behind"
    detail = f"the store's clock is {abs(skew):.3f} s {side} this host's"
    return Finding(
        "clock skew", status, f"{detail} (warn past {SKEW_WARN:g} s, fail past {SKEW_FAIL:g} s)"
    )


def _store_checks(env: Env) -> list[Finding]:
    """The backend's own ``diagnose()`` findings; raises what it raises."""
    if not isinstance(env.backend, Diagnosable):
        return []
    return [
        Finding(check.name, "ok" if check.ok else "fail", " ".join(check.detail.split()))
        for check in env.backend.diagnose()
    ]


def _diagnose(env: Env) -> list[Finding]:
    try:
        return _store_checks(env)
    except Exception as exc:
        return [Finding("diagnose", "fail", failure_text(exc))]


def _janitor(env: Env, interval: float | None) -> Finding:
    key = janitor_key(env.target.namespace)
    backend = env.backend
    records = backend.history(key=key, limit=1)
    running = backend.get(key)
    now = store_now(backend)
    busy = (
        "" if running is None else f"; running now, for {human_duration(now - running.acquired_at)}"
    )
    if not records:
        return Finding(
            "janitor",
            "warn",
            f"never ran: no record of {key} (is celery beat running, with "
            f"celery_dlock.install(app)? `reap` runs it once){busy}",
        )
    last = records[0]
    age = now - last.released_at
    when = f"last recorded run {human_duration(age)} ago ({local_time(last.released_at)})"
    if last.outcome is not Outcome.SUCCEEDED:
        first_line = (last.details or "").split("\n", 1)[0]
        return Finding("janitor", "warn", f"{when} and failed: {last.problem}: {first_line}{busy}")
    counts = last.result if isinstance(last.result, dict) else {}
    shown = (name for name in counts if name not in ("skipped", "quiet"))
    summary = ", ".join(f"{name} {counts[name]}" for name in shown)
    detail = f"{when}: {summary or 'no counts'}{busy}"
    if interval is not None and age > JANITOR_QUIET + JANITOR_LATE * interval:
        late = (
            f"more than {human_duration(JANITOR_QUIET)} (a run with nothing to do is "
            f"recorded hourly) and {JANITOR_LATE} × its {human_duration(interval)} interval"
        )
        return Finding("janitor", "warn", f"{detail}; {late}: is celery beat running?")
    return Finding("janitor", "ok", detail)


def run_checks(env: Env, interval: float | None) -> list[Finding]:
    """Every check, in order; after a failed connect only that one and the store's own
    checks if they ran (a store that answers but refuses the lock session, its tables
    missing or a pooler in the way, says why in them; the rest would only repeat it), and
    after a store that did not answer at all only that one (each would wait as long)."""
    first, answered = _connect(env)
    if not answered:
        return [first]
    if first.status == "fail":
        try:
            return [first, *_store_checks(env)]
        except Exception:
            return [first]
    findings = [first, _capabilities(env)]
    for check in (_clock_skew, _diagnose):
        try:
            result = check(env)
        except Exception as exc:
            result = Finding(check.__name__.strip("_").replace("_", " "), "fail", failure_text(exc))
        findings.extend(result if isinstance(result, list) else [result])
    try:
        findings.append(_janitor(env, interval))
    except Exception as exc:
        findings.append(Finding("janitor", "fail", failure_text(exc)))
    return findings


@click.command()
@click.option(
    "--janitor-interval",
    type=DURATION,
    help="Expected seconds between janitor runs (under Celery: dlock_janitor_interval); "
    f"a last recorded run older than an hour and {JANITOR_LATE} intervals is a warning "
    "(a run on the beat schedule with nothing to do is recorded once an hour).",
)
@JSON
@guarded
def doctor(env: Env, janitor_interval: float | None, as_json: bool) -> None:
    """Check the lock store and the janitor.

    Connection, capabilities, clock skew, the store's own checks (schema, pooler mode...)
    and the janitor's last run. Exit code 1 if a check failed; warnings do not fail.
    """
    interval = env.target.janitor_interval if janitor_interval is None else janitor_interval
    env.backend  # noqa: B018 - a bad URL is a usage error (exit 2), not a failed check
    findings = run_checks(env, interval)
    failed = [f for f in findings if f.status == "fail"]
    warned = [f for f in findings if f.status == "warn"]
    if as_json:
        env.emit_json(
            {
                "backend": env.url,
                "source": env.target.source,
                "namespace": env.target.namespace,
                "ok": not failed,
                "checks": [asdict(finding) for finding in findings],
            }
        )
    else:
        env.echo(f"backend    {env.url} (from {env.target.source})")
        env.echo(f"namespace  {env.target.namespace or '(none)'}")
        env.echo()
        rows = [[f.status, f.name, f.detail] for f in findings]
        env.echo(table(("status", "check", "detail"), rows))
        env.echo()
        if failed:
            env.echo(f"{len(failed)} of {len(findings)} checks failed")
        else:
            warnings = f" ({len(warned)} warning{'s' * (len(warned) > 1)})" if warned else ""
            env.echo(f"all checks passed{warnings}")
    click.get_current_context().exit(1 if failed else 0)
