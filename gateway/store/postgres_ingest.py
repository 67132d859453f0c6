"""A webhook batch on PostgreSQL in one statement, when it carries only messages (the common case).

The keys' claim and the new messages' inbox rows go in one statement outside a transaction, instead of
BEGIN, two statements (each compiled anew for its number of rows) and COMMIT: on PostgreSQL every round
trip costs the gateway CPU in the driver and the kernel. Keys are claimed in key order and the inbox's
trigger moves the queue heads in session order: the lock order of every batch (ingest.py). Statuses
and membership changes, rare, take ingest.py's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY

from gateway.domain.inbound import InboundMessage
from gateway.store import inbox
from gateway.store.postgres_lanes import PostgresLanes, Statement

__all__ = ["store_messages"]

# The inbox columns, in inbox.insert_params' order, one array each.
_INBOX = (
    "i_keys",
    "i_platforms",
    "i_sessions",
    "i_message_ids",
    "i_kinds",
    "i_texts",
    "i_messages",
    "i_statuses",
)
_CLAUSE = text(
    "WITH claimed AS (INSERT INTO chatflow_processed_messages (message_key, platform, processed_at, "
    "expires_at) SELECT k.key, k.platform, :now, :expires FROM unnest(:keys, :platforms) AS k(key, platform) "
    "ORDER BY k.key ON CONFLICT (message_key) DO UPDATE SET platform = excluded.platform, "
    "processed_at = excluded.processed_at, expires_at = excluded.expires_at "
    "WHERE chatflow_processed_messages.expires_at <= excluded.processed_at RETURNING message_key), "
    "stored AS (INSERT INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, "
    "message_json, status, attempts, next_attempt_at, received_at) SELECT r.key, r.platform, r.session_id, "
    "r.message_id, r.kind, r.text, CAST(r.message AS JSON), r.status, 0, :now, :now "
    f"FROM unnest({', '.join(':' + name for name in _INBOX)}) WITH ORDINALITY "
    "AS r(key, platform, session_id, message_id, kind, text, message, status, n) "
    "WHERE r.key IN (SELECT message_key FROM claimed) ORDER BY r.n ON CONFLICT DO NOTHING) "
    "SELECT message_key FROM claimed"
).bindparams(
    bindparam("now", type_=DateTime(timezone=True)),
    bindparam("expires", type_=DateTime(timezone=True)),
    *(bindparam(name, type_=ARRAY(Text)) for name in ("keys", "platforms", *_INBOX)),
)
_STATEMENT = Statement(_CLAUSE)


async def store_messages(
    lanes: PostgresLanes,
    keys: Sequence[tuple[str, str]],
    messages: Sequence[InboundMessage | None],
    pending: Sequence[bool],
    now: datetime,
    expires: datetime,
) -> set[str]:
    """Claim `keys` ((key, platform), in key order) and store those of `messages` (with whether each
    starts a turn) whose key was new; the keys that were."""
    rows = [inbox.insert_params(m, p, "") for m, p in zip(messages, pending, strict=True) if m is not None]
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(_INBOX)
    params: dict[str, Any] = {
        "now": now,
        "expires": expires,
        "keys": [key for key, _ in keys],
        "platforms": [platform for _, platform in keys],
        **{name: list(column) for name, column in zip(_INBOX, columns, strict=False)},
    }

    return {key for (key,) in await lanes.fetch(_STATEMENT, params, urgent=True)}
