"""Configuration from the environment (prefix ``DTASK_``) or a ``.env`` file.

Each trade-off is written next to its setting.
"""

from __future__ import annotations

import math
import os
import re
from functools import lru_cache
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Values that stand in for a secret: docker/.env.example's and the usual ones. Compared without case
# and without anything but letters and digits, so "Change_Me" and "change-me-too" are caught too.
PLACEHOLDER_WORDS = frozenset({"changeme", "secret", "password", "passw0rd", "placeholder", "example"})
PLACEHOLDER_PREFIXES = ("changeme", "replacewith", "replaceme")
_NOT_ALNUM = re.compile(r"[^a-z0-9]")


def is_placeholder(secret: str) -> bool:
    word = _NOT_ALNUM.sub("", secret.lower())
    return word in PLACEHOLDER_WORDS or word.startswith(PLACEHOLDER_PREFIXES)


def _refuse_placeholder(secret: str, what: str = "") -> None:
    if is_placeholder(secret):
        subject = f"{what} is a placeholder" if what else "a placeholder"
        raise ValueError(f"{subject} (like those in docker/.env.example): set a long random secret")


class Settings(BaseSettings):
    # Never echo a refused value: several settings hold passwords.
    model_config = SettingsConfigDict(
        env_prefix="DTASK_", env_file=".env", extra="ignore", hide_input_in_errors=True
    )

    # `postgresql+asyncpg://user:password@host/db` (`postgresql://` means the same). Unset means
    # "not configured": `dtask dev` then starts embedded servers; every other command refuses to
    # start rather than guess where the data lives.
    database_url: str | None = None
    # `redis://host:6379/0`: the transport of task ids. Unset: as for the database, no guessing.
    broker_url: str | None = None
    # Readiness facts live here; defaults to the broker.
    redis_url: str | None = None

    # Milvus server URI (`http://host:19530`) for the knowledge domain; unset: the knowledge routes
    # answer 503 naming it (`dtask dev` and the tests start `milvus-lite server`).
    milvus_uri: str | None = None
    # S3-compatible object store (`host:9000`) for uploaded files, with its credentials.
    minio_endpoint: str | None = None
    # Access key of the object store.
    minio_access_key: str | None = None
    # Secret key of the object store.
    minio_secret_key: str | None = None
    # Use HTTPS to reach the object store.
    minio_secure: bool = False
    # One bucket per deployment for uploaded originals, created on first use.
    minio_bucket: str = "dtask-knowledge"
    # Text -> vector: "hashing" (deterministic, local, no model download) or "module:attribute"
    # naming an Embedder (or a factory returning one). A base records the embedder it was built
    # with; indexing refuses to mix vector spaces.
    embedder: str = "hashing"
    # Deadline of each Milvus and S3 call, in the api and in workers. A stalled or unreachable store
    # then fails a call within this long as "unavailable": the api answers 503, and an ingest goes
    # back to pending with backoff (its slot freed) until the store answers again. Longer rides out
    # slower stores; shorter frees slots and answers callers sooner. Keep it under the lease, so a
    # store call an attempt starts has ended before anyone else could own the attempt's task.
    store_timeout_seconds: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # How often the knowledge verifier runs (a duty, like the reconciler): it checks that each
    # file's chunk rows, Milvus vectors and S3 original agree, re-queues a file whose do not, and
    # removes what failed or deleted work left behind (`dtask kb verify` does the same on demand).
    # Each run checks a bounded share of the bases and continues where the last one stopped. Unset: off.
    knowledge_verify_seconds: float | None = Field(default=600.0, gt=0, allow_inf_nan=False)
    # Largest uploaded file (413 naming the file).
    max_upload_bytes: int = Field(default=16 * 1024 * 1024, ge=1)
    # Files per upload request: the batch limit of one submission transaction.
    max_upload_files: int = Field(default=1000, ge=1, le=1000)
    # A whole multipart upload body (only POST /knowledge/bases/{id}/files takes more than
    # DTASK_MAX_REQUEST_BYTES); larger bodies get 413, unread when declared. Files stream through a
    # spool (on disk past 1 MB) to the object store, so this costs the api disk, not memory.
    max_upload_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    # Upload requests one api process reads at once. Each holds its body in spool files (disk
    # past 1 MB) and, while its files go to the object store, up to 8 parts of 5 MiB in memory
    # (measured: about 10 MB for one 60 MB file). More lets more clients upload at once; fewer
    # bounds the api's memory and disk tighter. One over it waits up to DTASK_UPLOAD_WAIT_SECONDS
    # for a turn, then gets 503 with Retry-After, before its body is read.
    max_concurrent_uploads: int = Field(default=4, ge=1)
    # How long an upload over DTASK_MAX_CONCURRENT_UPLOADS waits for a turn. Longer rides out a
    # burst; shorter tells the client sooner to come back (an upload holds its turn for as long as
    # its client takes to send the body).
    upload_wait_seconds: float = Field(default=5.0, gt=0, allow_inf_nan=False)

    # Lease: how long an owner may stay silent before another worker may recover its task.
    # Shorter recovers faster after a crash; longer tolerates longer GC/IO stalls and costs fewer
    # heartbeats. The heartbeat renews every lease/3, so two renewals may fail before it lapses.
    lease_seconds: float = Field(default=30.0, gt=0)
    # Beat intervals. Reconcile bounds recovery time (I3: lease + reconcile interval).
    reconcile_seconds: float = Field(default=10.0, gt=0)
    # Publish bounds how long a lost or dropped message can delay a pending task.
    publish_seconds: float = Field(default=15.0, gt=0)
    # How often beat runs the scheduler (schedules' due slots become tasks); unset: the publish
    # interval. A slot's task is created up to this long after its instant (its run_at is the
    # instant itself), and slots closer together than this collapse into one task per pass.
    schedule_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Upper bound for any task's timeout; may exceed 24 h: jobs that run for days exist.
    max_timeout_seconds: float = Field(default=172800.0, gt=0)
    # Default timeout of a type that does not declare one.
    default_timeout_seconds: float = Field(default=3600.0, gt=0)
    # Durable tasks running at once, cluster-wide, enforced in PostgreSQL (I5).
    capacity: int = Field(default=4, ge=1)
    # On worker shutdown, running handlers get this long to finish before they are stopped.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    # A handler told to stop (cancel, timeout, shutdown, lost lease) gets this long to clean up (the
    # lease is renewed meanwhile); one that is still running then is declared unresponsive, its
    # attempt ends failed (handler_unresponsive) and its pool process is recycled.
    cleanup_grace_seconds: float = Field(default=30.0, ge=0)
    # A worker warns, naming the handler, when its event loop stops turning for this long: in the
    # dense mode (`--pool threads`) one blocking handler stalls every neighbour's heartbeat. 0: off.
    loop_lag_warn_seconds: float = Field(default=0.5, ge=0)
    # Progress is persisted only when it moved at least this much (a new message always is).
    progress_delta: float = Field(default=1.0, ge=0)
    # Messages kept on the broker beyond the free slots, so a worker finds the next task queued the
    # moment a slot frees. Default: none while workers run their own picks (DTASK_WORKER_RUN_NEXT
    # above 0: the freed slot's next task is already in the process that freed it, and queued
    # messages only reach idle processes whose claims are refused: 651 vs 889 no-ops/s at capacity
    # 4), else the capacity. More only fills the broker with messages that will be refused.
    publish_ahead: int | None = Field(default=None, ge=0)
    # How PostgreSQL plans the statements of worker sessions (its plan_cache_mode). The claim and
    # terminal statements are prepared once per connection; left to "auto", PostgreSQL re-plans
    # several of them at every execution, about a quarter of the database's CPU per no-op task
    # (docs/benchmarks.md). Generic plans suit statements that look rows up by key or by partial
    # index, as ours do; "auto" for a handler whose own queries need plans for their values.
    worker_plan_cache_mode: Literal["auto", "force_generic_plan", "force_custom_plan"] = "force_generic_plan"
    # When a task ends, its terminal write picks what the freed slot takes next (the relay). A
    # worker process goes on to run up to this many of those picks itself, in a row, when they
    # are on the queue its own task came from: each is claimed under a fresh attempt token like
    # any task, only without a trip through the broker and Celery. That doubled no-op throughput
    # (docs/benchmarks.md). The costs: Flower shows one Celery task for the whole row, and
    # worker_max_tasks_per_child counts messages, not tasks. 0 sends every id through the broker.
    worker_run_next: int = Field(default=100, ge=0, le=100_000)
    # Most single submissions (Submitter.submit, POST /tasks) one process commits in one
    # transaction: those that arrive while a transaction is committing share the next one (group
    # commit, no timer: a lone submission commits at once). At 32 concurrent clients the api's CPU
    # per POST /tasks fell from 0.96 to 0.37 ms and its rate rose from 942 to 2,436/s
    # (docs/benchmarks.md). The cost: a transient database error fails every submission of its
    # group (each caller gets the error, nothing is stored); any other error retries the group's
    # submissions one by one. Requests with an Idempotency-Key, and owners under
    # DTASK_OWNER_MAX_PENDING, commit alone. 1: each submission its own transaction.
    submit_group_max: int = Field(default=1000, ge=1, le=1000)
    # Most pending tasks one publisher run sends: batches keep each duty run short and bounded.
    publish_batch: int = Field(default=500, ge=1)
    # Most expired leases one reconciler run converges (bounded, like the publisher's).
    reconcile_batch: int = Field(default=100, ge=1)
    # Readiness fact time-to-live; unset: max(3 x reconcile interval, 15 s), so one slow run is
    # not an outage.
    readiness_ttl_seconds: float | None = None
    # Backoff before a retry-safe task becomes claimable again: base * 2**(attempt-1), capped.
    retry_backoff_seconds: float = Field(default=5.0, ge=0)
    # Cap of the retry backoff.
    retry_backoff_max_seconds: float = Field(default=300.0, ge=0)
    # Worker processes per `dtask worker`; None = capacity + 2, so duties always find a free child.
    worker_concurrency: int | None = None
    # Largest task payload (JSON bytes); larger ones are refused with 422.
    max_payload_bytes: int = Field(default=1024 * 1024, ge=1)
    # Longest dedupe key, in characters.
    max_dedupe_key_length: int = Field(default=200, ge=1)
    # Every database statement the api sends has this deadline (and so does a new connection): with
    # PostgreSQL paused or gone, each route answers 503 within about two seconds instead of hanging.
    api_database_timeout_seconds: float = Field(default=1.5, gt=0, allow_inf_nan=False)
    # How long a request waits for one of the api's pooled connections when every one is busy (a
    # burst of batch submissions, each holding one for its transaction) before it gets 503. Longer
    # queues a burst instead of refusing it; shorter sheds load sooner. An outage is not waited
    # out here: a connection to a stopped or paused server fails within the deadline above.
    api_pool_wait_seconds: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    # A publish to the broker gives up after this long (the task stays pending and says why; the
    # publisher re-sends it): a paused Redis must not hold a submission.
    publish_timeout_seconds: float = Field(default=1.5, gt=0, allow_inf_nan=False)
    # Whole HTTP request bodies: 1,000 batch entries of ~8 KiB each. Larger ones get 413 before
    # anything is parsed: unread when declared, as soon as they pass it when chunked (an
    # unauthenticated one gets 401 before any byte is read).
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    # How long the api waits for each next piece of a request body before it answers 408 and
    # closes the connection (and, under `dtask api`, of a body it answered before reading, 401,
    # 413 or 503, before it closes): a client that stalls mid-body cannot hold a connection, or an
    # upload turn, for ever. Longer forgives worse networks; shorter frees stalled connections
    # sooner. It bounds each wait, not the whole body: a slow but steady upload is never cut.
    api_body_timeout_seconds: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # How long a client has to send a request's headers, from its connection (or the request's
    # first byte, on a kept-alive connection) on; then `dtask api` closes the connection. uvicorn
    # has no such deadline, so a client sending headers a byte at a time held a connection for
    # ever. Honest clients send headers in one packet: a few seconds is plenty.
    api_header_timeout_seconds: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # Connections and requests one `dtask api` process serves at once (uvicorn's limit_concurrency):
    # past it, requests get 503 at once. Every connection counts, idle kept-alive ones (5 s) too.
    # More serves bigger bursts; fewer bounds what a flood costs: each request may hold up to
    # DTASK_MAX_REQUEST_BYTES of JSON body while it is parsed.
    api_limit_concurrency: int = Field(default=500, ge=1)

    # Comma-separated extra spec modules (each defines SPECS), for task types outside this repo.
    extra_task_modules: str = ""
    # Beat prunes terminal tasks older than this; None keeps them until `dtask prune`.
    prune_after_seconds: float | None = Field(default=None, gt=0)

    # API keys, `name:secret` or `name:secret:admin`, comma-separated; the bearer token is the
    # secret. Duplicate secrets, secrets under 16 characters and the name `cli` are refused.
    api_keys: str = ""
    # Who may submit the built-in diagnostics types: admin keys only (default), every key, or
    # nobody. They exist for operators' smoke tests, not as free compute for every tenant.
    diagnostics: Literal["admin", "all", "off"] = "admin"
    # Per-owner limit of pending tasks, checked at submit (HTTP 429). Unset: none.
    owner_max_pending: int | None = Field(default=None, ge=1)
    # Per-owner limit of running tasks, enforced at claim like the capacity, so one tenant cannot
    # hold every slot while others wait (four slow documents of one tenant once held all four).
    # Unset: half the capacity, rounded up (2 of 4, 4 of 8; none below 2 slots). The other half
    # stays free for other owners: beside three hostile uploads of one tenant, another's 20 files
    # indexed as fast as alone. One owner alone runs at most that many at once: for ingest on 2
    # cores that cost nothing (25.5 files/s at 2 slots, 26.5 at 4), for tasks that mostly wait on
    # something else it halves a lone owner's throughput. Set it to DTASK_CAPACITY (one tenant, or
    # tenants you trust) for no per-owner limit. Tasks submitted through the Python API without an
    # owner are exempt.
    owner_max_running: int | None = Field(default=None, ge=1)
    # Workers add their counters to the shared Redis hash at most this often (and when they stop):
    # flushing after every task would cost a Redis round trip per task.
    metrics_flush_seconds: float = Field(default=1.0, ge=0)
    # Bearer token for /metrics (Prometheus' `authorization` setting). Unset: only admin API keys.
    metrics_token: str | None = None
    # /metrics serves figures at most this old: a scrape storm costs one query per interval, never
    # one table scan per scrape.
    metrics_cache_seconds: float = Field(default=15.0, ge=0)
    # `user:password` for Flower; without it `dtask flower` refuses to start (unless
    # `--insecure-local` on loopback).
    flower_basic_auth: str | None = None
    # The dashboard (/ui) links here for Celery's view of workers and messages (`dtask flower`'s default).
    flower_url: str = "http://127.0.0.1:5555"
    # A dashboard sign-in lasts this long at most (counted from the sign-in, by PostgreSQL's clock),
    # however busy the tab. Shorter limits what a stolen cookie is worth; longer asks for the key
    # less often. Signing out, or removing or changing the key, ends a session at once.
    ui_session_seconds: float = Field(default=12 * 3600.0, gt=0, le=30 * 86400, allow_inf_nan=False)
    # Where `dtask dev` keeps its embedded data, logs, ports and session key (`--data-dir`).
    dev_dir: str = ".dtask"

    @field_validator("database_url")
    @classmethod
    def _asyncpg_driver(cls, value: str | None) -> str | None:
        # `postgresql://` (what psql, libpq and hosting panels print) means asyncpg here: the one
        # driver this project ships. Normalised once, so every engine and Alembic see the same URL.
        scheme, sep, rest = (value or "").partition("://")
        if sep and scheme.lower() in ("postgresql", "postgres"):
            return f"postgresql+asyncpg://{rest}"
        return value

    # Copying docker/.env.example without setting real secrets must not start a deployment that
    # anyone can use: every process reads these settings, so api, worker and flower all refuse.
    @field_validator("api_keys")
    @classmethod
    def _api_secrets(cls, value: str) -> str:
        for entry in value.split(","):
            name, _, rest = entry.strip().partition(":")
            _refuse_placeholder(rest.partition(":")[0], f"the secret of {name!r}")
        return value

    @field_validator("flower_basic_auth")
    @classmethod
    def _flower_passwords(cls, value: str | None) -> str | None:
        for credential in (value or "").split(","):
            user, _, password = credential.strip().partition(":")
            _refuse_placeholder(password, f"the password of {user!r}")
        return value

    @field_validator("metrics_token", "minio_secret_key")
    @classmethod
    def _secret(cls, value: str | None) -> str | None:
        _refuse_placeholder(value or "")
        return value

    @field_validator(
        "lease_seconds", "reconcile_seconds", "publish_seconds", "max_timeout_seconds", "prune_after_seconds"
    )
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        if self.redis_url is None:
            self.redis_url = self.broker_url
        if self.readiness_ttl_seconds is None:
            self.readiness_ttl_seconds = max(3 * self.reconcile_seconds, 15.0)
        return self

    @property
    def owner_running_limit(self) -> int | None:
        """DTASK_OWNER_MAX_RUNNING, or its default share of the capacity; None: no limit (it would
        not be below the capacity)."""
        limit = self.owner_max_running
        if limit is None:
            limit = (self.capacity + 1) // 2
        return limit if 0 < limit < self.capacity else None

    @property
    def extra_modules(self) -> list[str]:
        return [m.strip() for m in self.extra_task_modules.split(",") if m.strip()]

    @property
    def scheduler_seconds(self) -> float:
        return self.schedule_seconds or self.publish_seconds

    @property
    def heartbeat_seconds(self) -> float:
        return self.lease_seconds / 3

    @property
    def ahead(self) -> int:
        if self.publish_ahead is not None:
            return self.publish_ahead
        return 0 if self.worker_run_next > 0 else self.capacity

    @property
    def concurrency(self) -> int:
        return self.worker_concurrency or self.capacity + 2

    def require_database(self) -> str:
        if not self.database_url:
            raise SystemExit(
                "DTASK_DATABASE_URL is not set (postgresql+asyncpg://user@host/db); "
                "`dtask dev` starts embedded servers when it is unset."
            )
        return self.database_url

    def require_broker(self) -> str:
        if not self.broker_url:
            raise SystemExit("DTASK_BROKER_URL is not set (redis://host:6379/0).")
        return self.broker_url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings; refused ones end it with one line per problem, naming the variable."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SystemExit("\n".join(f"refusing to start: {line}" for line in _describe(exc))) from None


# Reading Settings() (the environment and .env, validated) takes about 5 ms: a sixth of a small
# file's worker CPU when a handler did it for every task. Kept until the DTASK_* environment, or
# the directory whose .env it reads, changes (tests and benchmarks change both within a process).
_current: tuple[tuple[object, ...], Settings] | None = None


def current_settings() -> Settings:
    """Settings as the environment holds them now, read again only when it changed: for code that
    runs per task and must follow its process's environment."""
    global _current
    key = (os.getcwd(), *sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("DTASK_")))
    if _current is None or _current[0] != key:
        _current = (key, Settings())
    return _current[1]


def _describe(exc: ValidationError) -> list[str]:
    """``DTASK_X: why`` for each error (pydantic's own text spans lines and names fields, not variables)."""
    lines = []
    for error in exc.errors():
        cause = (error.get("ctx") or {}).get("error")
        why = str(cause) if isinstance(cause, ValueError) else error["msg"]
        where = "DTASK_" + str(error["loc"][0]).upper() if error["loc"] else "settings"
        lines.append(f"{where}: {why}")
    return lines
