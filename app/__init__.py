"""HTTP API: routers, auth and schemas. No execution logic: it submits through tasks_core."""
