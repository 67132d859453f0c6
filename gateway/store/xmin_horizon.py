"""PostgreSQL: how far back something holds the xmin horizon, read for /metrics.

Why: while a transaction keeps an old snapshot open (a long report, `pg_dump` on the primary, a
session left idle in a transaction), or a replication slot or a prepared transaction keeps an old
xmin, VACUUM cannot remove any row version that died after it. Every message rewrites its
conversation's queue heads and session row, so each of their look-ups then walks more versions, and
turns slow down the longer the hold lasts (`python benchmarks/soak.py` measures it). The server says
nothing about it by itself; these two figures let operators alert on it before users notice.

Sessions of other roles are counted too: `pg_stat_activity` shows every session's `backend_xmin`,
and its `xact_start` to members of `pg_read_all_stats` (or `pg_monitor`) only, so without that role
a snapshot held by another role counts in the transactions' figure and not in the seconds'.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from gateway.store.database import Database

# The scraping session's own snapshot is left out; the gateway's other sessions hold theirs for a
# statement at a time, so they show as ~0. So are autovacuum workers: others' horizons ignore a
# vacuum's xmin, and a long one on a big table is no alarm (to a role without pg_monitor their
# `backend_type` reads NULL, so they count there).
_HORIZON = text(
    "WITH held AS ("
    " SELECT backend_xmin AS xmin, xact_start AS since FROM pg_stat_activity"
    " WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()"
    " AND backend_type IS DISTINCT FROM 'autovacuum worker'"
    " UNION ALL SELECT transaction, prepared FROM pg_prepared_xacts"
    " UNION ALL SELECT xmin, NULL FROM pg_replication_slots"
    " UNION ALL SELECT catalog_xmin, NULL FROM pg_replication_slots)"
    " SELECT COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(since)), 0),"
    " COALESCE(max(age(xmin)), 0) FROM held"
)


@dataclass(frozen=True)
class Horizon:
    # Age of the oldest open transaction that holds a snapshot (another session's, or a prepared
    # transaction), in seconds; 0 when there is none.
    oldest_snapshot_seconds: float
    # Transactions since the oldest xmin a session, a replication slot or a prepared transaction holds.
    xids: int


async def read(db: Database) -> Horizon | None:
    """The horizon now; None on a database that has none (the SQLite file)."""
    if db.dialect != "postgresql":
        return None
    async with db.connect() as conn:
        seconds, xids = (await conn.execute(_HORIZON)).one()
    return Horizon(max(0.0, float(seconds)), int(xids))
