"""Persistence: tables, engines and migrations on SQLite or PostgreSQL."""
