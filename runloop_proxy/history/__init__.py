"""The history store: every session's full history in Redis (embedded or external)."""
