"""Torture: contended acquisitions under kills, pauses and store restarts, then a checker.

    python -m bench.torture --store file|postgres|pgbouncer|redis|redis-cluster|s3|gcs[,...]
        [--short|--long]
        [--workers 16] [--keys 8] [--seconds S] [--kills N] [--pauses N] [--restarts N]
        [--partitions N] [--diskfulls N] [--cut-off 2] [--cut-off-options QUERY]
        [--ttl 3] [--wait 2] [--hold 0.003] [--ledger file|postgres] [--broken]
        [--at-least N] [--limit N] [--together N]
        [--asyncio] [--hand-over] [--json PATH] [--keep DIR]
    python -m bench.torture.soak [--short] [--tasks 50000] [--kills 20] ...

For each store: a private server on a free port (``servers.py``: never the shared PostgreSQL
or Redis), a fenced ledger (``ledger.py``), M worker processes contending for K keys with hot
spots through the public ``celery_dlock.Lock`` (``worker.py``), each section a read-modify-
write of the ledger with its lease's fence; meanwhile a chaos thread (``chaos.py``) SIGKILLs
workers mid-section and starts new ones, SIGSTOPs one past its ttl, and restarts the store
(Postgres ``pg_ctl -m fast`` and ``-m immediate``; Redis on its ``appendfsync always`` file and
wiped). Then the checker (``check.py``) reads every log, the ledger and the store's history,
prints the results table and exits 1 on any violation. ``--broken`` swaps in a lock that
releases a busy key by key alone, to show the checker fails.

``--limit N``: each worker takes a key through ``Lock(limit=N)``, so up to N hold a key at
once, each in a slot ``key#i`` with its own lease and fence; the ledger and the checker
treat each slot as a key (one holder at a time, fences rising, every lease recorded).
``--together N``: each section takes N distinct keys at once, all or none
(``celery_dlock.lock([...])``, in key order), writes each key's ledger entry with that key's
fence and releases them; each lease is a section of its own to the checker. ``--asyncio``:
the workers take their key through ``AsyncLock`` on an event loop (the store's asyncio
client where it has one: Postgres, Redis; renewal as a task of the loop).
``--hand-over``: each lease is handed over as soon as it is granted
(``LockBackend.hand_over``, as a dedupe mark once its message is sent: alive by its ttl
alone), then the section, then the release by its token. The checker also holds that no
lease is recorded ``disconnected`` while its holder lived and reached its store.

Sections last at most ``--hold`` (3 ms), far below the ttl: renewal (every ttl / 3) never
runs. ``--ttl 1 --hold 2.5 --wait 5`` makes sections that outlive their ttl, kept by
renewal, with kills, pauses and restarts inside them (a few hundred acquisitions a minute).

``--partitions N`` (Postgres and Redis; root, ``ip`` and ``nft``): ``--cut-off`` more workers
run in a network namespace joined to the host by a veth pair (``netns.py``), reaching the
store on the host's end of the pair. A partition SIGSTOPs one of them inside its section,
drops every packet between namespace and host with nftables (dropped, not refused: no
socket is closed), waits until the store frees its lease (Postgres: the server's TCP
keepalives and ``tcp_user_timeout`` end the session, the cut-off workers having no ttl;
Redis: the lease's ttl), resumes it still cut off (its write is then stale and must be
refused), and heals the network. The table shows each partition's freeing time.
``--cut-off-options`` sets the cut-off workers' URL options (Postgres keepalives). The
ledger of a run with partitions is in files (the namespace reaches the store only).

``--store pgbouncer``: the Postgres store with ``liveness=ttl`` through a private PgBouncer in
transaction pooling mode (8 server connections), its cluster restarted behind the pooler.
``--store redis-cluster``: a private Redis Cluster (three primaries, a replica each, no
persistence); each restart is a failover: a primary (each in turn) cut off from its replica
for 0.2 s, so that what it writes then is lost as replication lag loses it, then SIGKILLed;
once its replica serves its slots it comes back as that one's replica. No partitions there
(the nodes announce loopback addresses, which the namespace cannot reach).

The object stores (``--store s3,gcs``): a private SeaweedFS (``s3://``) and a private
fake-gcs-server (``gs://``), started by ``tests/support/objectstore_servers.py`` for the run
and stopped after; chaos is kills and pauses only (no restarts: fake-gcs-server keeps its
objects in memory; no partitions). ttl and wait default to 1 s there (3-5 ms a call).

``--diskfulls N`` (file store, root): the store's directory is a tmpfs (8 MiB, and 1 MiB
more per second of the run for its history), which a filler file fills to the last byte
for a second, N times; acquires and releases then fail with ``BackendError`` (a store error
to the workers), and the checker's rules stay the same. A tmpfs still full at the end (of
history) fails the run.

``soak.py``: the Celery soak, through a real prefork worker (its own docstring).
``dedupesoak.py``: webhooks coalesced by ``dedupe``, through a real prefork worker, with
kills and restarts (its own docstring).

``--short`` is the CI size (about 12 s per store, ``tests/test_torture.py``; the file
store's disk full twice, as root); ``--long`` the issue's long mode. The ledger of a Postgres
run is a table with a unique name on the shared PostgreSQL (it must outlive the store's
restarts), dropped at the end.

Found by this harness and fixed: on the object stores, a killed holder's ``expired`` record,
which its taker writes into the lock object and then copies to ``history/``, was replaced by
the next record when that copy had failed or its writer had died (a 265 s GCS run, 1 in 10,979
acquisitions); a swap that replaces a record now copies it first
(``tests/backends/test_objectstore.py``).
"""
