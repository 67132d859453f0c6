"""PostgreSQL: a queue head's versions are keyed by `ver`, and every look-up reads the newest first.

Why: while a snapshot is held open (a long report, `pg_dump`, an idle replication slot) vacuum keeps
every head version written meanwhile, and a look-up by `(queue, session_id)` visited each of them
before the one it sees: a busy conversation's head is written about five times a message, so its
look-ups (the pushes at ingest and in the turn, the settle triggers' locks, the hinted claims, the
primary key's uniqueness check on each new version) cost more with every message since the snapshot
(docs/postgres-performance.md). Now each write sets `ver = ver + 1`, the primary key is
`(queue, session_id, ver)`, and a look-up scans it backwards with `LIMIT 1`: it stops at the newest
version, the one it sees, whatever older ones the snapshot keeps. A new version's uniqueness check
meets no older entry of its own key. One head per conversation still holds: heads are created only
by `chatflow_queue_heads_push`, under a transaction-scoped advisory lock of the conversation, after
looking for it again; heads are never deleted.
The SQLite file gets the column (always 0) and keeps its key and triggers: its look-ups never meet
old versions.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("chatflow_inbox", "chatflow_outbox")
HEADS = "chatflow_queue_heads"
PRIMARY_KEY = "pk_chatflow_queue_heads"
# The advisory lock class of a head's creation: the two-key form, a key space apart from the migrations'.
CREATION_LOCK_CLASS = 0x43480001

# Push rows' ids onto their conversations' heads (`sids` sorted: the lock order of batches committing
# at once): a head takes a row that is older than its own, or any when it has none.
_PUSH = f"""
CREATE OR REPLACE FUNCTION chatflow_queue_heads_push(
  q varchar, sids varchar[], ids bigint[], dues timestamptz[]) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  ats tid[];
  head_at tid;
BEGIN
  SELECT array_agg(h.at ORDER BY u.n) INTO ats
    FROM unnest(sids) WITH ORDINALITY AS u(sid, n)
    LEFT JOIN LATERAL (
      SELECT ctid AS at FROM {HEADS} WHERE queue = q AND session_id = u.sid
      ORDER BY ver DESC LIMIT 1 FOR UPDATE
    ) AS h ON true;
  UPDATE {HEADS} AS h
    SET ver = h.ver + 1, next_id = x.id,
        due_at = CASE WHEN h.lease_owner IS NULL THEN x.due ELSE h.due_at END
    FROM unnest(ats, ids, dues) AS x(at, id, due)
    WHERE h.ctid = x.at AND (h.next_id IS NULL OR x.id < h.next_id);
  IF array_position(ats, NULL) IS NULL THEN
    RETURN;
  END IF;
  FOR i IN 1 .. array_length(sids, 1) LOOP
    CONTINUE WHEN ats[i] IS NOT NULL;
    PERFORM pg_advisory_xact_lock({CREATION_LOCK_CLASS}, hashtext(q || ' ' || sids[i]));
    SELECT ctid INTO head_at FROM {HEADS} WHERE queue = q AND session_id = sids[i]
      ORDER BY ver DESC LIMIT 1 FOR UPDATE;
    IF head_at IS NULL THEN
      INSERT INTO {HEADS} (queue, session_id, ver, next_id, due_at) VALUES (q, sids[i], 0, ids[i], dues[i]);
    ELSE
      UPDATE {HEADS}
        SET ver = ver + 1, next_id = ids[i],
            due_at = CASE WHEN lease_owner IS NULL THEN dues[i] ELSE due_at END
        WHERE ctid = head_at AND (next_id IS NULL OR ids[i] < next_id);
    END IF;
  END LOOP;
END $$
"""
_STORED = """
DECLARE
  sids varchar[];
  ids bigint[];
  dues timestamptz[];
BEGIN
  SELECT array_agg(s.session_id ORDER BY s.session_id), array_agg(s.id ORDER BY s.session_id),
         array_agg(s.next_attempt_at ORDER BY s.session_id)
    INTO sids, ids, dues
    FROM (SELECT DISTINCT ON (session_id) session_id, id, next_attempt_at FROM stored
          WHERE status = 'pending' ORDER BY session_id, id) AS s;
  IF sids IS NOT NULL THEN
    PERFORM chatflow_queue_heads_push('{table}', sids, ids, dues);
  END IF;
  RETURN NULL;
END
"""
_PUSHED = """
BEGIN
  PERFORM chatflow_queue_heads_push(
    '{table}', ARRAY[NEW.session_id], ARRAY[NEW.id], ARRAY[NEW.next_attempt_at]);
  RETURN NULL;
END
"""


def _sibling(name: str) -> ModuleType:
    """An earlier migration, read from its file: the downgrade restores exactly what it installed."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"chatflow_migration_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"migration {name} not found at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settled_newest_first(body: str) -> str:
    """0018's settle, its head found newest first and each of its writes a new `ver`."""
    lock = "WHERE h.queue = '{table}' AND h.session_id = NEW.session_id FOR UPDATE;"
    newest = (
        "WHERE h.queue = '{table}' AND h.session_id = NEW.session_id ORDER BY h.ver DESC LIMIT 1 FOR UPDATE;"
    )
    changed = (
        body.replace(lock, newest)
        .replace(
            "UPDATE chatflow_queue_heads\n      SET next_id",
            "UPDATE chatflow_queue_heads\n      SET ver = ver + 1, next_id",
        )
        .replace(
            "UPDATE chatflow_queue_heads SET next_id",
            "UPDATE chatflow_queue_heads SET ver = ver + 1, next_id",
        )
    )
    if changed.count("ver = ver + 1") != 2 or "ORDER BY h.ver DESC" not in changed:
        raise RuntimeError("0018's settle is not what 0019 expects to change")
    return changed


def _function(name: str, body: str) -> None:
    op.execute(f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ {body} $$")


def upgrade() -> None:
    op.add_column(HEADS, sa.Column("ver", sa.BigInteger(), nullable=False, server_default="0"))
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_constraint(PRIMARY_KEY, HEADS, type_="primary")
    op.create_primary_key(PRIMARY_KEY, HEADS, ["queue", "session_id", "ver"])
    op.execute(_PUSH)
    settled = _settled_newest_first(_sibling("0018_queue_head_hand_on_in_place.py")._IN_PLACE)
    for table in TABLES:
        _function(f"{table}_heads_stored", _STORED.format(table=table))
        _function(f"{table}_head_pushed", _PUSHED.format(table=table))
        _function(f"{table}_head_settled", settled.format(table=table))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.execute(f"ALTER TABLE {HEADS} DROP COLUMN ver")  # SQLite 3.35 and later, in place
        return
    pushes = _sibling("0013_queue_head_push_only_when_older.py")
    settled = _sibling("0018_queue_head_hand_on_in_place.py")._IN_PLACE
    for table in TABLES:
        for statement in pushes._postgresql(table, pushes._CONFLICT_WHEN_OLDER):
            op.execute(statement)
        _function(f"{table}_head_settled", settled.format(table=table))
    op.execute("DROP FUNCTION chatflow_queue_heads_push(varchar, varchar[], bigint[], timestamptz[])")
    op.drop_constraint(PRIMARY_KEY, HEADS, type_="primary")
    op.create_primary_key(PRIMARY_KEY, HEADS, ["queue", "session_id"])
    op.drop_column(HEADS, "ver")
