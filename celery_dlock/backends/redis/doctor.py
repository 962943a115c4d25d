"""The doctor's findings for a Redis store, from ``INFO``."""

from __future__ import annotations

from celery_dlock.backends.base import Check

__all__ = ["checks"]


def checks(info: dict[str, str], cluster_client: bool = False, replicas: int = 0) -> list[Check]:
    """The doctor's findings from ``INFO``; scripts ran if we got this far. ``replicas``:
    the store's ``replicas`` option."""
    version = info.get("redis_version", "?")
    major = int(version.split(".")[0]) if version[:1].isdigit() else 0
    policy = info.get("maxmemory_policy", "?")
    evicting = "" if policy == "noeviction" else ": an evicted lock key is a lock given away"
    persistence = (
        "AOF on: locks and history survive a restart; with appendfsync everysec (the "
        "default) a crash can lose the last second's leases, whose holders see them lost "
        "while no lock is granted for restart_delay"
        if info.get("aof_enabled") == "1"
        else "no AOF: a restart that loses every key loses locks and history; holders see "
        "their leases lost and no lock is granted for restart_delay. With RDB snapshots "
        "(save points) a crash brings back the last snapshot instead: leases taken since "
        "are lost (no lock is granted for restart_delay, so their holders notice), leases "
        "released since are held again until their ttl runs out"
    )
    role = info.get("role", "?")
    cluster = info.get("cluster_enabled") == "1"
    return [
        Check("redis version", major >= 7, f"{version} (needs 7.0 or newer)"),
        Check("eviction", policy == "noeviction", f"maxmemory-policy {policy}{evicting}"),
        Check("persistence", True, persistence),
        Check(
            "role",
            role == "master",
            f"{role} (locks are written to the primary)"
            if role == "master"
            else f"{role}: a replica is read-only, every acquire fails (READONLY); point "
            "the URL at the primary",
        ),
        Check(
            "cluster mode",
            cluster_client or not cluster,
            ("on, and the URL is redis+cluster://: commands follow MOVED and ASK")
            if cluster_client
            else "on: a redis:// URL talks to one node and does not follow MOVED; use "
            "redis+cluster://host:port,host:port"
            if cluster
            else "off",
        ),
        Check("scripts", True, "EVALSHA runs (Lua scripting is allowed)"),
        _replicas(info, replicas),
    ]


def _replicas(info: dict[str, str], wanted: int) -> Check:
    """Whether the primary has the replicas that ``replicas=N`` waits for, or what a
    failover may undo without it."""
    text = info.get("connected_slaves", "0")
    connected = int(text) if text.isdigit() else 0
    if wanted:
        return Check(
            "replicas",
            connected >= wanted,
            f"replicas={wanted}: releases wait for {wanted}; this primary has {connected} "
            "connected"
            + ("" if connected >= wanted else ": every release fails until enough are back"),
        )
    detail = f"{connected} connected; replicas=0: a release counts once the primary has it"
    if connected:
        detail += (
            ", and a failover to a replica that lacks it brings the lease back (a dedupe "
            f"mark until its dedupe_ttl) or forgets a once success: replicas={connected} "
            "waits for them"
        )
    return Check("replicas", True, detail)
