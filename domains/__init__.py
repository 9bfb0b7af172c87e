"""Domains: each owns its tables, handlers and hooks, and registers them by module path."""
