"""durable-tasks runtime: PostgreSQL owns task intent, state and leases; Celery carries task ids."""
