"""Every statement of the task store, named, and the fragments they are built from.

Every time comes from PostgreSQL (``clock_timestamp()``), never from a worker. Tests may pin "now"
through the ``:now`` parameter (``TaskStore.now``); it replaces ``clock_timestamp()`` everywhere.

Fencing: a write by an attempt carries ``attempt_token = :tok AND status = 'running' AND
lease_expires_at > now``; zero rows means the attempt no longer owns the task.

The transitions that end an attempt are spelled once here (``end_attempt``, ``free_slot``,
``TERMINAL_SET``, ``PENDING_SET``) and composed into the owner's terminal write (FINISH_SQL), the
reconciler's and canceller's (CONVERGE_SQL) and the hand-back to pending (TO_PENDING_SQL).
"""

from __future__ import annotations

from tasks_core.model import LEGACY_VERSION
from tasks_core.store.execute import Statement

NOW = "coalesce(CAST(:now AS timestamptz), clock_timestamp())"
OWNED = f"attempt_token = :tok AND status = 'running' AND lease_expires_at > {NOW}"
# SQLSTATE lock_not_available: raised when lock_timeout expires.
LOCK_NOT_AVAILABLE = "55P03"
ACTIVE_SQL = "('pending', 'running')"
TERMINAL_SQL = "('success', 'failed', 'cancelled')"
# An Idempotency-Key answers retries for this long (24 h).
IDEMPOTENCY_TTL_SECONDS = 24 * 3600
# waiting_reason counts at most this many older pending tasks of the same owner.
WAITING_COUNT_CAP = 1000


def _owner_under_limit(ending: str | None = None) -> str:
    """The row's owner runs fewer than :omax tasks (no limit when :omax is NULL; tasks without an
    owner, submitted through the Python API, are exempt). Evaluated on `tasks` rows (claim, relay,
    publisher). ``ending``: a CTE of rows this same statement takes out of running, which its
    snapshot still counts (the terminal write's relay: its own finishing task)."""
    running = "(SELECT count(*) FROM tasks mine WHERE mine.status = 'running' AND mine.owner = tasks.owner)"
    if ending is not None:
        running += f" - (SELECT count(*) FROM {ending} WHERE {ending}.owner = tasks.owner)"
    return f"""(CAST(:omax AS int) IS NULL OR tasks.owner IS NULL
    OR {running} < CAST(:omax AS int))"""


OWNER_UNDER_LIMIT = _owner_under_limit()
# The row's type is paused by an operator (evaluated on `tasks` rows: claim, relay, publisher). The
# paused types are read once per statement (InitPlans) and tested as a filter, guarded by "any at
# all": as a correlated NOT EXISTS, or unguarded, the relay's generic plan became a sequential scan
# and sort of every pending row instead of a walk of ix_tasks_unpublished in its order.
TYPE_PAUSED = """(EXISTS (SELECT 1 FROM paused_types)
    AND tasks.task_type = ANY (ARRAY(SELECT task_type FROM paused_types)))"""
# A slot row held for a task that is not running under the slot's token.
ORPHAN_SLOT = """s.task_id IS NOT NULL AND NOT EXISTS (
    SELECT 1 FROM tasks t WHERE t.id = s.task_id AND t.status = 'running' AND t.attempt_token = s.token)"""


# ---------------------------------------------------------------- transitions

# To a terminal status (:status, with :result or :error), the attempt's token and lease cleared,
# which also frees the dedupe key. Cancel intent turns a success into `cancelled` (:cancelled is
# its error); nothing but a success sets the result or the full progress.
TERMINAL_SET = f"""status = CASE WHEN :status = 'success' AND cancel_requested_at IS NOT NULL
                          THEN 'cancelled' ELSE :status END,
            result = CASE WHEN :status = 'success' AND cancel_requested_at IS NULL
                          THEN CAST(:result AS jsonb) END,
            error = CASE WHEN :status = 'success' AND cancel_requested_at IS NOT NULL
                         THEN CAST(:cancelled AS jsonb) ELSE CAST(:error AS jsonb) END,
            progress = CASE WHEN :status = 'success' AND cancel_requested_at IS NULL THEN 100
                            ELSE progress END,
            finished_at = {NOW}, attempt_token = NULL, lease_expires_at = NULL"""
# Back to pending, claimable again after :delay seconds, with no message in flight (the relay or
# the publisher sends one); :message, if given, says why it waits.
PENDING_SET = f"""status = 'pending', attempt_token = NULL, lease_expires_at = NULL,
                       not_before = {NOW} + make_interval(secs => :delay), last_published_at = NULL,
                       message = coalesce(CAST(:message AS text), message)"""


def end_attempt(ending: str, ended_at: str) -> str:
    """Record attempt :tok as ended (:outcome, :detail) at ``ended_at``, joined to the CTE
    ``ending`` (the row this statement moves out of running). A success that cancel intent turned
    into `cancelled` ends `cancelled`."""
    return f"""UPDATE task_attempts SET ended_at = {ended_at}, detail = :detail,
               outcome = CASE WHEN {ending}.status = 'cancelled' AND :status = 'success'
                              THEN 'cancelled' ELSE :outcome END
        FROM {ending} WHERE task_attempts.token = :tok AND task_attempts.ended_at IS NULL"""


def free_slot(ending: str) -> str:
    """Give back the capacity slot held by the task of the CTE ``ending``."""
    return f"""UPDATE task_slots SET task_id = NULL, token = NULL
        FROM {ending} WHERE task_slots.task_id = {ending}.id"""


def _due_ctes(freed: str = "0", *, ending: str | None = None, republish: bool = False) -> str:
    """`budget` and `due`: the runnable pending tasks capacity can take now, higher priority first,
    then older (see take_due), locked for stamping. ``freed``: slots this same statement gives back,
    which its snapshot still sees as held; ``ending``: the CTE of the task(s) it ends, which its
    snapshot still sees running for their owner. Without ``republish`` only tasks with no message
    in flight are due (the relay's case, which ix_tasks_unpublished serves whatever the plan); with
    it also those published longer than ``:after`` seconds ago (the publisher's)."""
    unsent = "last_published_at IS NULL"
    if republish:
        unsent = f"({unsent} OR last_published_at < {NOW} - make_interval(secs => :after))"
    return f"""budget AS (
        SELECT CASE WHEN CAST(:cap AS int) IS NULL THEN CAST(:limit AS int) ELSE
            CAST(:cap AS int) + CAST(:ahead AS int) + ({freed})
            - (SELECT count(*) FROM task_slots WHERE task_id IS NOT NULL)
            - (SELECT count(*) FROM (
                  SELECT 1 FROM tasks WHERE status = 'pending'
                    AND last_published_at > {NOW} - make_interval(secs => :window)
                  LIMIT CAST(:cap AS int) + CAST(:ahead AS int)) flight) END AS n),
    due AS (
        SELECT id FROM tasks
        WHERE status = 'pending' AND cancel_requested_at IS NULL
          AND (not_before IS NULL OR not_before <= {NOW})
          AND NOT {TYPE_PAUSED}
          AND {unsent}
          AND (task_type, handler_version) IN (
              SELECT * FROM unnest(CAST(:types AS text[]), CAST(:versions AS int[])))
          AND {_owner_under_limit(ending)}
        ORDER BY priority DESC, created_at, id
        LIMIT least(CAST(:limit AS int), greatest(0, (SELECT n FROM budget)))
        FOR UPDATE SKIP LOCKED)"""


# ---------------------------------------------------------------- claim

# The claim, in one statement: a free slot below the capacity (skipping slots other claimers hold),
# the task marked running under the new token only if it is still pending, wanted, due, of a type
# not paused and of a runnable type and version (and, on the locked path, under its type's cap and
# owner's limit), the slot taken, the attempt recorded. No slot, or no longer pending: nothing
# changes. A claim of a task that is not pending (a late or duplicate message) locks no slot at
# all: locked, that slot would be skipped by a concurrent claim of a pending task, refused
# `capacity_full` with a slot free.
CLAIM_SQL = Statement(
    f"""WITH slot AS (
        SELECT slot FROM task_slots WHERE slot < :cap AND task_id IS NULL
          AND EXISTS (SELECT 1 FROM tasks WHERE id = :id AND status = 'pending'
                      AND cancel_requested_at IS NULL)
        ORDER BY slot LIMIT 1 FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE tasks SET status = 'running', attempt_token = :tok, attempt_count = attempt_count + 1,
               lease_expires_at = {NOW} + make_interval(secs => :lease), heartbeat_at = {NOW},
               started_at = coalesce(started_at, {NOW}), not_before = NULL
        WHERE id = :id AND status = 'pending' AND cancel_requested_at IS NULL
          AND (not_before IS NULL OR not_before <= {NOW})
          AND NOT {TYPE_PAUSED}
          AND (task_type, handler_version) IN (
              SELECT * FROM unnest(CAST(:types AS text[]), CAST(:versions AS int[])))
          AND EXISTS (SELECT 1 FROM slot)
          AND NOT EXISTS (
              SELECT 1 FROM unnest(CAST(:ctypes AS text[]), CAST(:ccaps AS int[])) AS c(task_type, cap)
              WHERE c.task_type = tasks.task_type
                AND (SELECT count(*) FROM tasks mine WHERE mine.status = 'running'
                     AND mine.task_type = c.task_type) >= c.cap)
          AND {OWNER_UNDER_LIMIT}
        RETURNING *),
    taken AS (
        UPDATE task_slots SET task_id = claimed.id, token = claimed.attempt_token
        FROM slot, claimed WHERE task_slots.slot = slot.slot),
    attempt AS (
        INSERT INTO task_attempts (task_id, attempt, token, worker, claimed_at)
        SELECT id, attempt_count, attempt_token, :worker, heartbeat_at FROM claimed)
    SELECT * FROM claimed"""
)
CLAIM_TARGET_SQL = Statement("SELECT task_type, owner FROM tasks WHERE id = :id")
LOCK_TIMEOUT_SQL = Statement("SELECT set_config('lock_timeout', :ms, true)")
ADVISORY_LOCK_SQL = Statement("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))")
ENSURE_SLOTS_SQL = Statement(
    """INSERT INTO task_slots (slot) SELECT generate_series(0, :cap - 1)
                        ON CONFLICT (slot) DO NOTHING"""
)
FREE_ORPHAN_SLOTS_SQL = Statement(f"UPDATE task_slots s SET task_id = NULL, token = NULL WHERE {ORPHAN_SLOT}")
# A refused message was acknowledged and dropped, so none is in flight for the task any more:
# clear its publication stamp, and the relay (when a slot frees) or the publisher re-sends it.
_UNPUBLISH = "UPDATE tasks SET last_published_at = NULL WHERE id = :id AND status = 'pending'"
UNPUBLISH_SQL = Statement(_UNPUBLISH)
# Why a claim took nothing: the facts, read in the statement that marks a pending task without
# cancel intent for re-sending.
REFUSAL_SQL = Statement(
    f"""WITH marked AS (
                            {_UNPUBLISH} AND cancel_requested_at IS NULL RETURNING id)
                        SELECT status, cancel_requested_at IS NOT NULL AS cancel, task_type, handler_version,
                               not_before > {NOW} AS backoff, {TYPE_PAUSED} AS paused,
                               NOT {OWNER_UNDER_LIMIT} AS owner_full,
                               NOT EXISTS (SELECT 1 FROM task_slots WHERE slot < :cap AND task_id IS NULL)
                                 AS full,
                               (SELECT count(*) FROM task_slots WHERE slot < :cap) < :cap AS missing,
                               EXISTS (SELECT 1 FROM task_slots s WHERE s.slot < :cap AND {ORPHAN_SLOT})
                                 AS stale
                        FROM tasks WHERE id = :id"""
)

# ---------------------------------------------------------------- owner writes

HEARTBEAT_SQL = Statement(
    f"""UPDATE tasks SET lease_expires_at = {NOW} + make_interval(secs => :lease),
                               heartbeat_at = {NOW}
                        WHERE id = :id AND {OWNED} RETURNING cancel_requested_at IS NOT NULL"""
)
REPORT_SQL = Statement(
    f"""UPDATE tasks SET progress = coalesce(CAST(:progress AS float8), progress),
                           message = coalesce(CAST(:message AS text), message)
                    WHERE id = :id AND {OWNED}"""
)
LOCK_OWNED_SQL = Statement(f"SELECT * FROM tasks WHERE id = :id AND {OWNED} FOR UPDATE")
LEASE_HOLDS_SQL = Statement(f"SELECT CAST(:lease AS timestamptz) > {NOW}")
TASK_TYPE_SQL = Statement("SELECT task_type, handler_version FROM tasks WHERE id = :id")
ATTEMPT_OUTCOME_SQL = Statement(
    """SELECT t.status FROM task_attempts a JOIN tasks t ON t.id = a.task_id
                        WHERE a.token = :tok AND a.ended_at IS NOT NULL AND t.attempt_token IS NULL
                          AND t.attempt_count = a.attempt AND a.outcome <> 'lease_expired'"""
)
# The owner's terminal statement: fenced like every owner write; the attempt is recorded as ended
# and the capacity slot given back in the same statement. It also does the relay's work: the freed
# slot's next tasks are stamped as published and returned (relay_ids, relay_types) for the caller
# to send after commit — one statement per task fewer than a separate relay (`:limit` 0: none).
FINISH_SQL = Statement(
    f"""WITH prior AS (
        SELECT id, lease_expires_at FROM tasks WHERE id = :id AND {OWNED} FOR UPDATE),
    done AS (
        UPDATE tasks SET
            {TERMINAL_SET}
        FROM prior WHERE tasks.id = prior.id
        RETURNING tasks.*, prior.lease_expires_at AS lease_was),
    ended AS (
        {end_attempt("done", NOW)}),
    freed AS (
        {free_slot("done")}),
    {_due_ctes(freed="SELECT count(*) FROM done", ending="done")},
    relayed AS (
        UPDATE tasks t SET last_published_at = {NOW}, publish_error = NULL
        FROM due WHERE t.id = due.id AND EXISTS (SELECT 1 FROM done)
        RETURNING t.id, t.priority, t.created_at, t.task_type)
    SELECT done.*,
        (SELECT array_agg(id ORDER BY priority DESC, created_at, id) FROM relayed) AS relay_ids,
        (SELECT array_agg(task_type ORDER BY priority DESC, created_at, id) FROM relayed) AS relay_types
    FROM done"""
)

# ---------------------------------------------------------------- transitions by others

def _out_of_running(task_set: str) -> str:
    """Task :id, whose row the caller holds locked, leaves running by ``task_set``; its attempt
    :tok ends and its slot is freed. A dead owner's attempt ended when its lease (:lease) lapsed,
    not when we noticed."""
    return f"""WITH done AS (
        UPDATE tasks SET
            {task_set}
        WHERE id = :id
        RETURNING tasks.*),
    ended AS (
        {end_attempt("done", f"least({NOW}, :lease)")}),
    freed AS (
        {free_slot("done")})
    SELECT count(*) FROM done"""


# The terminal transition by someone other than the owner (the reconciler, a cancel): the same
# transition as FINISH_SQL, unfenced.
CONVERGE_SQL = Statement(_out_of_running(TERMINAL_SET))
# Back to pending (its owner handing it back, or the reconciler retrying an expired lease).
TO_PENDING_SQL = Statement(_out_of_running(PENDING_SET))
SET_ERROR_SQL = Statement("UPDATE tasks SET error = CAST(:error AS jsonb) WHERE id = :id")

# ---------------------------------------------------------------- submit and publish

# What the relay and a submission send (RELAY_DUE_SQL), and the publisher (PUBLISH_DUE_SQL: also
# what was sent long ago), in one statement each (see take_due).
_STAMP_DUE = f"""UPDATE tasks t SET last_published_at = {NOW}, publish_error = NULL
    FROM due WHERE t.id = due.id
    RETURNING t.id, t.priority, t.created_at, t.task_type"""
RELAY_DUE_SQL = Statement(f"WITH {_due_ctes()}\n    {_STAMP_DUE}")
PUBLISH_DUE_SQL = Statement(f"WITH {_due_ctes(republish=True)}\n    {_STAMP_DUE}")
# A submission's insert (one row, or many in order); a held dedupe key inserts nothing, and the
# holder is looked up. Built once: a text() per call cost a submission 2% of the api's CPU.
_ON_HELD_KEY = f"""ON CONFLICT (owner, task_type, dedupe_key)
        WHERE status IN {ACTIVE_SQL} AND dedupe_key IS NOT NULL
    DO NOTHING RETURNING *"""
# The instant a submission asks for: run_at as given, or PostgreSQL's now + delay_seconds; NULL
# (neither): claimable at once. It is also the row's not_before, which the claim and due tests read.
def _run_at(at: str, delay: str) -> str:
    return f"coalesce(CAST({at} AS timestamptz), {NOW} + make_interval(secs => CAST({delay} AS float8)))"


INSERT_SQL = Statement(
    f"""INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, dedupe_key,
                       timeout_seconds, created_at, run_at, not_before, priority, retry_of)
    SELECT :id, :tt, :hv, CAST(:payload AS jsonb), :owner, 'pending', :dk, :timeout, {NOW}, at, at, :prio,
           :retry_of
    FROM (SELECT {_run_at(":run_at", ":delay")} AS at) scheduled
    {_ON_HELD_KEY}"""
)
INSERT_MANY_SQL = Statement(
    f"""INSERT INTO tasks (id, task_type, handler_version, payload, owner, status, dedupe_key,
                       timeout_seconds, created_at, run_at, not_before, priority, retry_of)
    SELECT id, task_type, hv, CAST(payload AS jsonb), owner, 'pending', key, timeout, {NOW},
           scheduled.at, scheduled.at, prio, retry_of
    FROM unnest(CAST(:ids AS uuid[]), CAST(:types AS text[]), CAST(:versions AS int[]),
                CAST(:payloads AS text[]), CAST(:owners AS text[]), CAST(:keys AS text[]),
                CAST(:timeouts AS float8[]), CAST(:run_ats AS timestamptz[]), CAST(:delays AS float8[]),
                CAST(:prios AS int[]), CAST(:retry_ofs AS uuid[]))
         WITH ORDINALITY AS n(id, task_type, hv, payload, owner, key, timeout, run_at, delay, prio, retry_of,
                              ord)
    CROSS JOIN LATERAL (SELECT {_run_at("n.run_at", "n.delay")} AS at) scheduled
    ORDER BY ord
    {_ON_HELD_KEY}"""
)
DEDUPE_HOLDER_SQL = Statement(
    f"""SELECT id FROM tasks WHERE owner IS NOT DISTINCT FROM :owner
    AND task_type = :tt AND dedupe_key = :dk AND status IN {ACTIVE_SQL}"""
)
TAKE_IDEMPOTENCY_KEY_SQL = Statement(
    f"""INSERT INTO idempotency_keys (owner, key, request_hash, task_ids, created_at)
            VALUES (:owner, :key, :hash, '[]'::jsonb, {NOW})
            ON CONFLICT (owner, key) DO NOTHING RETURNING key"""
)
EARLIER_IDEMPOTENCY_KEY_SQL = Statement(
    f"""SELECT request_hash, response, created_at < {NOW} - make_interval(secs => :ttl)
                          AS expired
                    FROM idempotency_keys WHERE owner = :owner AND key = :key FOR UPDATE"""
)
FORGET_IDEMPOTENCY_KEY_SQL = Statement("DELETE FROM idempotency_keys WHERE owner = :owner AND key = :key")
RECORD_IDEMPOTENT_ANSWER_SQL = Statement(
    """UPDATE idempotency_keys SET task_ids = CAST(:ids AS jsonb), response = CAST(:resp AS jsonb)
                WHERE owner = :owner AND key = :key"""
)
PRUNE_IDEMPOTENCY_KEYS_SQL = Statement(
    f"""DELETE FROM idempotency_keys WHERE (owner, key) IN (
                            SELECT owner, key FROM idempotency_keys
                            WHERE created_at < {NOW} - make_interval(secs => :ttl)
                            LIMIT :batch FOR UPDATE SKIP LOCKED)"""
)
OWNER_QUOTA_LOCK_SQL = Statement(
    "SELECT pg_advisory_xact_lock(hashtextextended('dtask-owner-quota:' || :owner, 0))"
)
OWNER_PENDING_SQL = Statement(
    """SELECT count(*) FROM (SELECT 1 FROM tasks WHERE status = 'pending'
                        AND owner = :owner LIMIT :limit) mine"""
)
# A retry by hand: the tasks it retries, locked (in id order, so two bulk retries never deadlock),
# and the link from each to its retry, set only where none is (a task is retried at most once).
LOCK_FOR_RETRY_SQL = Statement(
    "SELECT * FROM tasks WHERE id = ANY(CAST(:ids AS uuid[])) ORDER BY id FOR UPDATE"
)
MARK_RETRIED_SQL = Statement(
    "UPDATE tasks SET retried_by = :new WHERE id = :id AND retried_by IS NULL RETURNING id"
)
MARK_PUBLISH_FAILED_SQL = Statement(
    """UPDATE tasks SET publish_error = :err, last_published_at = NULL
                        WHERE id = ANY(:ids) AND status = 'pending'"""
)

# ---------------------------------------------------------------- cancel, delete, prune, reconcile

LOCK_TASK_SQL = Statement("SELECT * FROM tasks WHERE id = :id FOR UPDATE")
CANCEL_PENDING_SQL = Statement(f"UPDATE tasks SET cancel_requested_at = {NOW} WHERE id = :id")
CANCEL_RUNNING_SQL = Statement(
    f"""UPDATE tasks SET cancel_requested_at = coalesce(cancel_requested_at, {NOW})
                        WHERE id = :id"""
)
LOCK_STATUS_SQL = Statement("SELECT status FROM tasks WHERE id = :id FOR UPDATE")
DELETE_SQL = Statement("DELETE FROM tasks WHERE id = :id")
PRUNE_SQL = Statement(
    f"""DELETE FROM tasks WHERE id IN (
                                SELECT id FROM tasks WHERE status IN {TERMINAL_SQL}
                                  AND finished_at < {NOW} - make_interval(secs => :age)
                                LIMIT :batch FOR UPDATE SKIP LOCKED)"""
)
END_STALLED_SESSIONS_SQL = Statement(
    f"""SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                        WHERE datname = current_database() AND pid <> pg_backend_pid()
                          AND application_name LIKE 'dtask-worker:%'
                          AND xact_start < {NOW} - make_interval(secs => :age)"""
)
NEXT_TO_RECONCILE_SQL = Statement(
    f"""SELECT * FROM tasks
                            WHERE NOT (id = ANY(:skip)) AND (
                                (status = 'running' AND lease_expires_at <= {NOW})
                                OR (status IN {ACTIVE_SQL} AND handler_version = {LEGACY_VERSION})
                                OR (status = 'pending' AND cancel_requested_at IS NOT NULL))
                            ORDER BY lease_expires_at NULLS FIRST LIMIT 1 FOR UPDATE SKIP LOCKED"""
)
# The running attempts of a worker node's processes: every attempt names its process
# `<node>:<pid>`, so :prefix is `<node>:`. Only running tasks are read (a partial index), each
# joined to its attempt by the token.
RUNNING_ATTEMPTS_OF_SQL = Statement(
    """SELECT a.worker, t.attempt_token FROM tasks t JOIN task_attempts a ON a.token = t.attempt_token
                        WHERE t.status = 'running' AND starts_with(a.worker, :prefix)"""
)
# Early expiry: the attempts whose process is known to be dead lose their lease now, by their
# tokens (no one else can hold them), so the reconciler's next pass moves their tasks on as it
# does a lapsed lease. Fenced: an attempt that ended meanwhile (its token cleared) or whose lease
# already ran out is untouched.
EXPIRE_ATTEMPTS_SQL = Statement(
    f"""UPDATE tasks SET lease_expires_at = {NOW}
                        WHERE status = 'running' AND attempt_token = ANY(CAST(:toks AS uuid[]))
                          AND lease_expires_at > {NOW}
                        RETURNING id"""
)
LEGACY_BACKLOG_SQL = Statement(
    f"""SELECT status, count(*) FROM tasks
                    WHERE handler_version = {LEGACY_VERSION} AND status IN {ACTIVE_SQL} GROUP BY status"""
)
UNRUNNABLE_PENDING_SQL = Statement(
    f"""SELECT * FROM tasks
                        WHERE status = 'pending' AND handler_version <> {LEGACY_VERSION}
                          AND (task_type, handler_version) NOT IN (
                              SELECT * FROM unnest(CAST(:types AS text[]), CAST(:versions AS int[])))
                        LIMIT :batch FOR UPDATE SKIP LOCKED"""
)

# ---------------------------------------------------------------- paused types

PAUSE_TYPE_SQL = Statement(
    f"""INSERT INTO paused_types (task_type, paused_by, paused_at) VALUES (:tt, :by, {NOW})
                      ON CONFLICT (task_type) DO NOTHING"""
)
RESUME_TYPE_SQL = Statement("DELETE FROM paused_types WHERE task_type = :tt RETURNING task_type")
PAUSED_TYPES_SQL = Statement("SELECT * FROM paused_types ORDER BY task_type")

# ---------------------------------------------------------------- reads

GET_SQL = Statement("SELECT * FROM tasks WHERE id = :id")
ATTEMPTS_SQL = Statement("SELECT * FROM task_attempts WHERE task_id = :id ORDER BY attempt")
SCHEMA_REVISION_SQL = Statement("SELECT version_num FROM alembic_version")
OLDEST_PENDING_AGE_SQL = Statement(
    f"""SELECT extract(epoch FROM {NOW} - min(created_at)) FROM tasks
                        WHERE status = 'pending'"""
)
_SUMMARY = "SELECT task_type, status, count(*) FROM tasks {where} GROUP BY task_type, status"
SUMMARY_SQL = Statement(_SUMMARY.format(where=""))
OWNER_SUMMARY_SQL = Statement(_SUMMARY.format(where="WHERE owner = :owner"))


def list_sql(conds: list[str]) -> Statement:
    """The listing, newest first, with only the filters given as predicates (a ``CAST(:x) IS NULL
    OR ...`` form would keep the planner off the owner index)."""
    where = f"WHERE {' AND '.join(conds)}" if conds else ""
    return Statement(f"SELECT * FROM tasks {where} ORDER BY created_at DESC, id DESC LIMIT :limit")


LIST_STATUS = "status = :status"
LIST_TYPE = "task_type = :tt"
LIST_OWNER = "owner = :owner"
LIST_AFTER = "(created_at, id) < (CAST(:c_at AS timestamptz), CAST(:c_id AS uuid))"


def waiting_facts_sql(ownerless: bool) -> str:
    """What waiting_reason reads. The older tasks are counted in index order, newest first, so the
    scan stops at the cap: unordered, PostgreSQL built a bitmap of the owner's whole pending queue
    first (2x slower at 100 k pending than at 1 k). The cap is a constant of the statement: as a
    parameter, PostgreSQL re-planned it on every call at 100 k pending in `dtask bench scale`
    (0.61 vs 0.36 ms)."""
    same_owner = "owner IS NULL" if ownerless else "owner = :owner"
    return f"""SELECT CAST(:nb AS timestamptz) > {NOW} AS backoff,
        EXISTS (SELECT 1 FROM paused_types WHERE task_type = :tt) AS paused,
        (SELECT count(*) FROM tasks WHERE status = 'running') AS running,
        (SELECT count(*) FROM tasks WHERE status = 'running' AND {same_owner}) AS mine_running,
        (SELECT count(*) FROM (SELECT 1 FROM tasks WHERE status = 'pending' AND {same_owner}
           AND (created_at, id) < (CAST(:created AS timestamptz), CAST(:id AS uuid))
           ORDER BY created_at DESC, id DESC
           LIMIT {WAITING_COUNT_CAP + 1}) older) AS ahead"""


WAITING_FACTS_SQL = {ownerless: Statement(waiting_facts_sql(ownerless)) for ownerless in (False, True)}
