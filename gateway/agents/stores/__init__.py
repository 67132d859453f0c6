"""Session stores: in memory, and SQL (SQLite or PostgreSQL) on the gateway's own tables."""
