"""API tokens: created once, printed once, stored as a SHA-256 hash."""
