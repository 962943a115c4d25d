"""SQL functions for clients that are not Python: psql, a report in another language, a
stored procedure. They take and release the same leases as the Python client, with the same
fences, liveness (the caller's session holds the lease's advisory lock) and history::

    SELECT * FROM dlock.acquire('job:report:daily', 'nightly-report on db-1', 300);
        -- token, fence; no row while the key is held
    SELECT dlock.release('job:report:daily', '<token>', 'failed', 'ValueError', 'bad row');
        -- the outcome recorded, or NULL when the lease was not ours any more
    SELECT * FROM dlock.lease('job:report:daily');

Each function body is the Python client's own statement with its parameters bound to the
function's arguments (no SQL is built from an argument at run time), ``SECURITY INVOKER``
with a fixed ``search_path``. Created by ``migrate()``.
"""

from __future__ import annotations

import re

from celery_dlock.backends.base import MAX_KEY_BYTES, MAX_TTL
from celery_dlock.backends.postgres.statements import HANDED_OVER, Statements
from celery_dlock.records import Outcome

__all__ = ["functions"]

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
#: Outcomes a caller may record (the store writes expiries and disconnections itself, and
#: ``forgotten`` is the record of an operator's ``celery-dlock forget``, never a release).
_GIVEN = tuple(
    o.value for o in Outcome if o not in (Outcome.EXPIRED, Outcome.DISCONNECTED, Outcome.FORGOTTEN)
)


def _bind(statement: str, names: dict[str, str]) -> str:
    """``statement`` with each ``%(name)s`` replaced by the SQL expression ``names[name]``."""
    return _PLACEHOLDER.sub(lambda match: names[match.group(1)], statement)


def _function(name: str, arguments: str, returns: str, body: str) -> str:
    return (
        f"CREATE OR REPLACE FUNCTION {name}({arguments}) RETURNS {returns}\n"
        "LANGUAGE plpgsql VOLATILE SECURITY INVOKER SET search_path = pg_catalog, pg_temp\n"
        f"AS $dlock$\n#variable_conflict use_column\n{body}\n$dlock$"
    )


def functions(statements: Statements) -> list[str]:
    """The ``CREATE OR REPLACE FUNCTION`` statements of ``acquire``, ``release`` and
    ``lease`` in the store's schema (names with its table prefix).

    Always those of session liveness, whatever ``statements``' own: an SQL client's lease
    lives as long as its session, and a ``migrate()`` through a pooler (``liveness=ttl``)
    made functions whose leases named no session and, without a ttl, never ended."""
    statements = Statements(statements.names)
    n, keys = statements.names, statements.keys
    # plpgsql runs a SELECT whose result it drops as PERFORM.
    guard = "\n".join(
        f"    {re.sub(r'^SELECT ', 'PERFORM ', line)};" for line in statements.restore_guard
    )
    holder = (
        "json_build_object('host', coalesce(host(inet_client_addr()), 'local socket'), "
        "'pid', pg_backend_pid(), 'started', NULL, 'host_id', '', "
        "'nonce', substr(v_token, 1, 16), 'worker', p_holder, 'task_id', NULL, "
        "'task_name', 'sql')::text"
    )
    common = {"key": "p_key", "token": "v_token", "holder": "v_holder", "ttl": "p_ttl"}
    acquire = _bind(statements.acquire, common)
    take_over = _bind(
        statements.take_over,
        common | {"replace": "NULL", "retried": "NULL", "held": "v_held"},
    )
    ours = keys.held(" AND p.pid = pg_backend_pid() AND p.objid = (v_fence & 4294967295)::oid")
    acquire_body = f"""DECLARE
  v_token text := md5(random()::text || clock_timestamp()::text || pg_backend_pid()::text);
  v_holder text;
  v_held int8[];
  v_fence int8;
  v_at float8;
  v_until float8;
  v_locked boolean;
  v_pid integer;
  v_ended text;
  v_old int8;
  v_unlocked boolean;
BEGIN
  IF p_key IS NULL OR p_key = '' OR p_holder IS NULL OR p_holder = '' THEN
    RAISE EXCEPTION 'acquire needs a key and a holder: the % is %',
      CASE WHEN coalesce(p_key, '') = '' THEN 'key' ELSE 'holder' END,
      CASE WHEN p_key IS NULL OR (p_key <> '' AND p_holder IS NULL) THEN 'NULL' ELSE 'empty' END
      USING ERRCODE = '22004';
  END IF;
  IF octet_length(p_holder) > {MAX_KEY_BYTES} THEN
    RAISE EXCEPTION 'a holder is at most {MAX_KEY_BYTES} bytes, not %', octet_length(p_holder)
      USING ERRCODE = '22023';
  END IF;
  IF octet_length(p_key) > {MAX_KEY_BYTES} OR p_key ~ '[\x01-\x1f\x7f-\x9f\u2028\u2029]' THEN
    RAISE EXCEPTION 'a key is at most {MAX_KEY_BYTES} bytes of UTF-8, without control '
      'characters, as in Python: not %', left(p_key, 60) USING ERRCODE = '22023';
  END IF;
  IF p_ttl IS NOT NULL AND NOT (p_ttl > 0 AND p_ttl <= {MAX_TTL:.0f}) THEN
    RAISE EXCEPTION 'ttl must be seconds > 0 up to {MAX_TTL:.0f} (ten years) or NULL, not %',
      p_ttl USING ERRCODE = '22023';
  END IF;
  IF NOT EXISTS (SELECT FROM {n.guard}) THEN  -- after a crash: fences move up first
{guard}
  END IF;
  -- This session's advisory locks of leases no longer its own (an acquire rolled back, a
  -- lease released or forced from another session): let go, or they pile up in a pooled
  -- session. Only this session makes rows with its pid, so an orphan never turns live.
  PERFORM pg_advisory_unlock({keys.of("o.objid::int8")})
  FROM ({keys.held(" AND p.pid = pg_backend_pid()", "p.objid ")}) AS o
  WHERE NOT EXISTS (SELECT FROM {n.locks} AS l WHERE l.backend_pid = pg_backend_pid()
                    AND (l.fence & 4294967295) = o.objid::int8);
  v_holder := {holder};
  {acquire}
  INTO v_fence, v_at, v_until, v_locked, v_pid;
  IF NOT FOUND THEN
    v_held := ARRAY(SELECT l.fence FROM {n.locks} AS l
                    WHERE l.key = p_key AND l.backend_pid = pg_backend_pid());
    {take_over}
    INTO v_ended, v_fence, v_at, v_until, v_locked, v_pid, v_old, v_unlocked;
    IF NOT FOUND THEN
      RETURN;  -- held by a live holder
    END IF;
  END IF;
  IF NOT v_locked THEN
    RAISE EXCEPTION 'the advisory lock of fence % is taken: two sessions on one lease', v_fence;
  END IF;
  token := v_token;
  fence := v_fence;
  RETURN NEXT;
END"""
    release = _bind(
        statements.release,
        {
            "key": "p_key",
            "token": "p_token",
            "outcome": "p_outcome",
            "problem": "p_problem",
            "details": "p_details",
            "result": "NULL",
            "unlock": "v_unlock",
        },
    )
    given = ", ".join(f"'{value}'" for value in _GIVEN)
    release_body = f"""DECLARE
  v_fence int8;
  v_unlock boolean;
  v_released float8;
  v_outcome text;
  v_at float8;
  v_until float8;
  v_unlocked boolean;
  v_waiters boolean;
BEGIN
  IF p_outcome IS NULL OR p_outcome NOT IN ({given}) THEN
    RAISE EXCEPTION 'outcome must be one of {", ".join(_GIVEN)}, not %', p_outcome
      USING ERRCODE = '22023';
  END IF;
  SELECT l.fence INTO v_fence FROM {n.locks} AS l WHERE l.key = p_key AND l.token = p_token;
  IF NOT FOUND THEN
    RETURN NULL;  -- not ours any more: released, reaped, or taken over
  END IF;
  v_unlock := EXISTS ({ours});
  {release}
  INTO v_released, v_outcome, v_at, v_until, v_unlocked, v_waiters;
  RETURN v_outcome;
END"""
    live = keys.live("l.fence")
    lease_body = f"""BEGIN
  RETURN QUERY
  SELECT l.token, l.fence, l.holder, l.acquired_at, l.expires_at,
         (l.expires_at IS NULL OR l.expires_at > clock_timestamp())
         AND (l.backend_pid = {HANDED_OVER} OR {live})
  FROM {n.locks} AS l WHERE l.key = p_key;
END"""
    return [
        _function(
            n.table("acquire"),
            "p_key text, p_holder text, p_ttl float8 DEFAULT NULL",
            "TABLE (token text, fence bigint)",
            acquire_body,
        ),
        _function(
            n.table("release"),
            "p_key text, p_token text, p_outcome text DEFAULT 'succeeded', "
            "p_problem text DEFAULT NULL, p_details text DEFAULT NULL",
            "text",
            release_body,
        ),
        _function(
            n.table("lease"),
            "p_key text",
            "TABLE (token text, fence bigint, holder json, acquired_at timestamptz, "
            "expires_at timestamptz, alive boolean)",
            lease_body,
        ),
    ]
