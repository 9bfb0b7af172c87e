"""`dtask bench WORKLOAD`: benchmarks of the durable path against its transport and its database.

Each workload (one module each) creates its own temporary PostgreSQL database and uses its own Redis
DB index, runs its compared variants in alternating rounds, and writes one JSON result file. Shared
machinery lives in ``common`` (databases, Redis, worker processes) and ``report`` (statistics,
tables, JSON). Nothing here is imported by the runtime.
"""

WORKLOADS = ("throughput", "submit", "latency", "recovery", "scale", "soak", "density")
