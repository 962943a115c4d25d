"""The page of ``celery dlock serve``: a Flask app over one lock store (the ``[web]`` extra).

- ``/``: the live leases (key, holder, age, fence, expiry; gone holders marked; the oldest
  ``limit`` of them, with the count of all), the history
  with filters (key prefix, outcome, problems only, time range, limit), each record's
  exception type and message, its traceback one click away, and the timeline picture of the
  same range, as wide as the window (see :mod:`celery_dlock.cli.timeline`); without a
  ``since``, the last hour from just before its oldest lease, as the command draws it;
- ``/timeline.svg``: that picture alone (the ``timeline`` command's);
- ``/metrics``: store-wide gauges in Prometheus's text format: leases held, the oldest
  lease's age, records by outcome in the window;
- ``POST /release``: only with ``allow_release``: a lease released by its token, recorded
  ``forced`` with who and why; it needs the server's secret and a CSRF token
  (double-submitted: a cookie and a form field that must match).

Read-only otherwise. Every query parameter is checked: a bad one is a 400 that names it.
Text from the store (keys, holders, messages) is escaped by Jinja's autoescaping; the store's
URL is shown with its password masked.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flask import Flask, Response, abort, make_response, render_template_string, request
from werkzeug.exceptions import HTTPException

from celery_dlock.backends import mask_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.cli.render import (
    PROBLEM_OUTCOMES,
    SINCE,
    expires_text,
    holder_gone,
    holder_text,
    human_duration,
    local_time,
)
from celery_dlock.cli.timeline import COLOURS, Bar, Window, newest_matching, render_svg
from celery_dlock.errors import DLockError, LockKeyError
from celery_dlock.keys import validate_key
from celery_dlock.records import Lease, Outcome, Record

__all__ = ["MAX_LIMIT", "Page", "make_app"]

#: The most history records one page asks the store for.
MAX_LIMIT = 5000
_PROBLEMS = tuple(outcome.value for outcome in PROBLEM_OUTCOMES)
_CSRF_COOKIE = "dlock_csrf"


@dataclass(frozen=True)
class Page:
    """What a request asked to see, checked."""

    prefix: str
    outcome: Outcome | None
    problems: bool
    since: float
    until: float
    limit: int
    since_given: bool = False  # else the picture's window is fitted to its leases

    def window(self, bars: list[Bar]) -> Window:
        """The picture's window: as given, or fitted to ``bars``."""
        if self.since_given:
            return Window(self.since, self.until, self.since)
        return Window.fit(self.since, self.until, bars)


def make_app(
    backend: LockBackend,
    *,
    prefix: str = "job:",
    release_secret: str | None = None,
) -> Flask:
    """The app over ``backend``; ``prefix`` is the default key prefix shown. Releasing is on
    only with a ``release_secret`` (what an operator types to release)."""
    app = Flask("celery_dlock.cli.web")
    app.config["MAX_CONTENT_LENGTH"] = 16 * 1024
    where = mask_url(backend.url)

    password = urlsplit(backend.url).password

    def scrub(text: str) -> str:
        return text.replace(password, "***") if password else text

    @app.errorhandler(HTTPException)
    def _error(exc: HTTPException) -> Response:
        return _plain(f"{exc.code} {exc.name}: {exc.description}\n", exc.code or 500)

    @app.errorhandler(DLockError)
    def _store_failed(exc: DLockError) -> Response:
        return _plain(scrub(f"503 the lock store failed: {type(exc).__name__}: {exc}\n"), 503)

    @app.get("/")
    def index() -> Response:
        page = _page(prefix)
        now = time.time()
        leases, held = _leases(backend, page)
        records = _records(backend, page)
        bars = [Bar.of(r) for r in records] + [
            Bar(lease, lease.acquired_at, now, "held") for lease in leases
        ]
        csrf = request.cookies.get(_CSRF_COOKIE) or secrets.token_urlsafe(24)
        window = page.window(bars)
        html = render_template_string(
            _TEMPLATE,
            where=where,
            page=page,
            outcomes=[o.value for o in Outcome],
            leases=[_lease_row(lease, now) for lease in leases],
            held=held,
            records=[_record_row(record) for record in records],
            svg=render_svg(bars, window, fluid=True),
            colours=COLOURS,
            since_text=local_time(window.start),
            until_text=local_time(window.end),
            fitted_since=local_time(window.asked) if window.fitted else "",
            releasing=release_secret is not None,
            csrf=csrf,
            since_arg=request.args.get("since", ""),
            until_arg=request.args.get("until", ""),
        )
        response = make_response(html)
        response.set_cookie(_CSRF_COOKIE, csrf, httponly=True, samesite="Strict")
        return response

    @app.get("/timeline.svg")
    def timeline() -> Response:
        page = _page(prefix)
        now = time.time()
        records = _records(backend, page)
        bars = [Bar.of(r) for r in records]
        bars += [Bar(lease, lease.acquired_at, now, "held") for lease in _leases(backend, page)[0]]
        return Response(render_svg(bars, page.window(bars)), mimetype="image/svg+xml")

    @app.get("/metrics")
    def metrics() -> Response:
        page = _page(prefix)
        return Response(_metrics(backend, page), mimetype="text/plain; version=0.0.4")

    @app.post("/release")
    def release() -> Response:
        if release_secret is None:
            abort(403, "releasing is off: start the server with --allow-release")
        form = request.form
        cookie = request.cookies.get(_CSRF_COOKIE, "")
        if not cookie or not _same(cookie, form.get("csrf", "")):
            abort(403, "the form's CSRF token does not match: reload the page")
        if not _same(release_secret, form.get("secret", "")):
            abort(403, "wrong release secret")
        key, token = form.get("key", ""), form.get("token", "")
        who, why = form.get("who", "").strip(), form.get("why", "").strip()
        if not who or not why:
            abort(400, "say who releases and why")
        _checked_key(key)
        lease = backend.get(key)
        if lease is None or not _same(lease.token, token):
            abort(409, "that lease is not on the key any more: nothing was released")
        details = f"released by {who} from the celery-dlock page ({request.remote_addr}): {why}"
        record = backend.release(lease, Outcome.FORCED, "forced", details[:2000])
        if record is None:
            abort(409, "the lease ended before it could be released: nothing was touched")
        return Response(
            f"released {key} (fence {lease.fence}), recorded as forced\n", mimetype="text/plain"
        )

    return app


def _plain(text: str, status: int) -> Response:
    """An error as plain text, which no browser may take for HTML (it may quote a key)."""
    response = Response(text, status=status, mimetype="text/plain")
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


#: The page's query parameters (its filters), in the form's order.
_PARAMETERS = frozenset(("key", "outcome", "problems", "since", "until", "limit"))
_YES = ("1", "on", "true", "yes")


def _page(default_prefix: str) -> Page:
    """The request's filters, checked (a 400 naming the first bad one)."""
    args = request.args
    unknown = sorted(set(args) - _PARAMETERS)
    if unknown:  # a misspelt filter (prefix=) would show the page unfiltered
        abort(
            400, f"unknown parameter {unknown[0]}: the filters are {', '.join(sorted(_PARAMETERS))}"
        )
    prefix = args.get("key", default_prefix)
    if len(prefix) > 1024 or any(ord(c) < 32 for c in prefix):
        abort(400, "key: at most 1024 characters, no control characters")
    outcome = None
    if args.get("outcome"):
        try:
            outcome = Outcome(args["outcome"])
        except ValueError:
            names = ", ".join(o.value for o in Outcome)
            abort(400, f"outcome: one of {names}")
    problems = args.get("problems", "").lower()
    if problems not in (*_YES, "", "0", "off", "false", "no"):
        abort(400, "problems: 1 or 0 (on/off, true/false, yes/no)")
    if problems in _YES and outcome is not None and outcome.value not in _PROBLEMS:
        abort(400, f"outcome: {outcome.value} is not a problem (problems: {', '.join(_PROBLEMS)})")
    since_given = bool(args.get("since"))  # an empty field of the form is none
    since = _time(args["since"], "since") if since_given else _time("1h", "since")
    until = _time(args["until"], "until") if args.get("until") else time.time()
    if until <= since:
        abort(400, "until must be after since")
    try:
        limit = int(args.get("limit", "500"))
    except ValueError:
        abort(400, "limit: a whole number")
    if not 1 <= limit <= MAX_LIMIT:
        abort(400, f"limit: from 1 to {MAX_LIMIT}")
    return Page(prefix, outcome, problems in _YES, since, until, limit, since_given)


def _time(text: str, name: str) -> float:
    try:
        value: float = SINCE.convert(text, None, None)
    except Exception:  # click's BadParameter, with the forms it takes
        abort(400, f"{name}: a duration back from now (10m, 2h, 1d) or an ISO time")
    return value


def _same(expected: str, given: str) -> bool:
    """A constant-time comparison of any text (``compare_digest`` refuses non-ASCII str)."""
    return hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8", "replace"))


def _checked_key(key: str) -> None:
    try:
        validate_key(key)
    except LockKeyError as exc:
        abort(400, f"key: {exc}")


def _records(backend: LockBackend, page: Page) -> list[Record]:
    kinds: list[Outcome | None] = [page.outcome]
    if page.problems:
        kinds = [Outcome(p) for p in _PROBLEMS if page.outcome is None or p == page.outcome.value]
    found = [
        record
        for kind in kinds
        for record in newest_matching(
            backend, page.prefix, outcome=kind, since=page.since, until=page.until, limit=page.limit
        )
    ]
    found.sort(key=lambda record: record.released_at, reverse=True)
    return found[: page.limit]


def _leases(backend: LockBackend, page: Page) -> tuple[list[Lease], int]:
    """The oldest ``page.limit`` leases under the prefix (a stuck one is what an operator
    looks for), in key order, and how many are held in all: a backlog of thousands keeps
    the page a page."""
    leases = sorted(backend.leases(page.prefix), key=lambda lease: lease.acquired_at)
    return sorted(leases[: page.limit], key=lambda lease: lease.key), len(leases)


def _lease_row(lease: Any, now: float) -> dict[str, Any]:
    return {
        "key": lease.key,
        "token": lease.token,
        "holder": holder_text(lease),
        "gone": holder_gone(lease),
        "age": human_duration(now - lease.acquired_at),
        "fence": lease.fence,
        "expires": expires_text(lease, now),
    }


def _record_row(record: Record) -> dict[str, Any]:
    details = record.details or ""
    message, _, traceback = details.partition("\n")
    problem = record.problem or ""
    if problem and message.startswith(f"{problem}:"):  # "once: once: ..." said it twice
        message = message[len(problem) + 1 :].lstrip()
    return {
        "released": local_time(record.released_at),
        "key": record.key,
        "outcome": record.outcome.value,
        "colour": COLOURS.get(record.outcome.value, "#000"),
        "problem": problem,
        "message": message,
        "traceback": traceback.strip(),
        "fence": record.fence,
        "holder": record.lease.holder.describe(),
        "held": human_duration(record.released_at - record.lease.acquired_at),
    }


def _metrics(backend: LockBackend, page: Page) -> str:
    now = time.time()
    leases = backend.leases(page.prefix)
    oldest = max((now - lease.acquired_at for lease in leases), default=0.0)
    # One query per outcome, each of at most MAX_LIMIT records of the prefix in the window:
    # a busy store's successes must not crowd its failures out of the count, nor other
    # keys' records this prefix's.
    counts = {
        outcome.value: len(
            newest_matching(
                backend,
                page.prefix,
                outcome=outcome,
                since=page.since,
                until=page.until,
                limit=MAX_LIMIT,
            )
        )
        for outcome in Outcome
    }
    lines = [
        "# HELP dlock_store_leases_held Leases held now in the store.",
        "# TYPE dlock_store_leases_held gauge",
        f"dlock_store_leases_held {len(leases)}",
        "# HELP dlock_store_oldest_lease_age_seconds Age of the oldest lease held now.",
        "# TYPE dlock_store_oldest_lease_age_seconds gauge",
        f"dlock_store_oldest_lease_age_seconds {oldest:.3f}",
        "# HELP dlock_store_records Records in the history window, by outcome "
        f"(at most {MAX_LIMIT} each).",
        "# TYPE dlock_store_records gauge",
    ]
    lines += [
        f'dlock_store_records{{outcome="{outcome.value}"}} {counts.get(outcome.value, 0)}'
        for outcome in Outcome
    ]
    return "\n".join(lines) + "\n"


_TEMPLATE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"/><title>celery-dlock: {{ where }}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"/>
<style>
body { font-family: sans-serif; margin: 1em 2em; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
/* a window narrower than a table or the picture scrolls that one sideways, not the page */
table { display: block; max-width: 100%; overflow-x: auto; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: left; font-size: 13px; }
td.outcome { color: white; font-weight: bold; }
.gone { color: #c62828; font-weight: bold; }
pre { font-size: 11px; max-width: 1000px; overflow-x: auto; }
form.filters label { margin-right: 1em; }
#timeline { overflow-x: auto; margin-bottom: 1em; }
</style></head><body>
<h1>celery-dlock</h1>
<p>Store: <code id="store">{{ where }}</code>. Window {{ since_text }} to {{ until_text }}
{%- if fitted_since %}, fitted to the leases since {{ fitted_since }}{% endif %}.
<a href="/metrics">/metrics</a></p>
<h2>Held now ({{ held }})</h2>
{% if held > leases|length %}<p id="more">The oldest {{ leases|length }} shown: narrow the
key prefix, or raise the limit.</p>{% endif %}
<table id="leases"><tr><th>key</th><th>holder</th><th>age</th><th>fence</th><th>expires</th>
{% if releasing %}<th>release</th>{% endif %}</tr>
{% for lease in leases %}<tr class="lease">
<td class="key">{{ lease.key }}</td>
<td class="holder{% if lease.gone %} gone{% endif %}">{{ lease.holder }}</td>
<td>{{ lease.age }}</td><td class="fence">{{ lease.fence }}</td><td>{{ lease.expires }}</td>
{% if releasing %}<td><form method="post" action="/release">
<input type="hidden" name="csrf" value="{{ csrf }}"/>
<input type="hidden" name="key" value="{{ lease.key }}"/>
<input type="hidden" name="token" value="{{ lease.token }}"/>
<input name="who" placeholder="who" size="8"/> <input name="why" placeholder="why" size="14"/>
<input name="secret" type="password" placeholder="secret" size="8"/>
<button type="submit">release</button></form></td>{% endif %}
</tr>{% endfor %}</table>
<h2>History</h2>
<form class="filters" method="get" action="/">
<label>key prefix <input name="key" value="{{ page.prefix }}"/></label>
<label>outcome <select name="outcome"><option value="">any</option>
{% for name in outcomes %}<option
{%- if page.outcome and page.outcome.value == name %} selected{% endif %}>{{ name }}</option>
{% endfor %}
</select></label>
<label><input type="checkbox" name="problems" value="1"
{%- if page.problems %} checked{% endif %}/> problems only</label>
<label>since <input name="since" value="{{ since_arg }}" size="18"
placeholder="1h, fitted"/></label>
<label>until <input name="until" value="{{ until_arg }}" size="18" placeholder="now"/></label>
<label>limit <input name="limit" value="{{ page.limit }}" size="5"/></label>
<button type="submit" id="apply">show</button></form>
<div id="timeline">{{ svg|safe }}</div>
<table id="history"><tr><th>released</th><th>key</th><th>outcome</th><th>problem</th>
<th>fence</th><th>holder</th><th>held</th></tr>
{% for r in records %}<tr class="record" data-outcome="{{ r.outcome }}">
<td>{{ r.released }}</td><td class="key">{{ r.key }}</td>
<td class="outcome" style="background: {{ r.colour }}">{{ r.outcome }}</td>
<td class="problem">{{ r.problem }}{% if r.message %}: {{ r.message }}{% endif %}
{% if r.traceback %}<details><summary>traceback</summary>
<pre>{{ r.traceback }}</pre></details>{% endif %}</td>
<td>{{ r.fence }}</td><td>{{ r.holder }}</td><td>{{ r.held }}</td></tr>{% endfor %}
</table></body></html>
"""
