"""The campaign's checker: what PostgreSQL holds after a fault campaign, judged against I1-I7.

It reads the tasks, the attempts audit trail, ``diagnostics_effects`` (one row per step written by a
``diagnostics.sleep`` handler inside an owning transaction, stamped with its attempt token) and
``diagnostics_runs`` (the domain row the hooks converge), plus the facts only the campaign could see
live (transport outages, expired leases it watched, stalls). Each invariant becomes a count that
must be 0. Every time compared here was written by PostgreSQL's ``clock_timestamp()``.

One more count is a promise rather than an invariant: a PostgreSQL restart shorter than the
remaining lease delays a running task, it does not end it (``check_restart_survival``).

The checks are pure functions of :class:`Snapshot` and :class:`Observations`, so they can be fed
hand-built histories (a violating history must be reported).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

TERMINAL = ("success", "failed", "cancelled")
ACTIVE = ("pending", "running")
EXAMPLES = 5

Row = dict[str, Any]


@dataclass(frozen=True)
class Bounds:
    """The protocol timings the cluster ran with; every time bound below is built from them."""

    capacity: int
    lease_seconds: float
    reconcile_seconds: float
    publish_seconds: float
    margin_seconds: float
    # The longest a worker waits between two tries of a call while the database does not answer
    # (tasks_core.worker.lease.MAX_BACKOFF, and the heartbeat's own cap): how long after PostgreSQL is back
    # a lease must still hold for its owner to be sure to renew it.
    retry_gap_seconds: float = 1.0

    @property
    def heartbeat_seconds(self) -> float:
        return self.lease_seconds / 3

    @property
    def recovery_seconds(self) -> float:
        """How long after a lease's end its task may still be running: I3's "lease + reconcile
        interval of its owner's death", measured from what the database records.

        A lease ends one lease after the owner's last renewal, and a live owner renews every
        heartbeat interval, so the owner died at most one heartbeat after that renewal:
        death + lease + reconcile <= lease end + heartbeat + reconcile. Plus the margin."""
        return self.heartbeat_seconds + self.reconcile_seconds + self.margin_seconds

    @property
    def stall_seconds(self) -> float:
        """Longest a due pending task may wait, with capacity free and no claim anywhere.

        A lost message is re-sent by the publisher once it is ``publish`` old, and the publisher
        itself runs every ``publish``: two intervals, then a reconcile's relay, plus margin."""
        return 2 * self.publish_seconds + self.reconcile_seconds + self.margin_seconds


@dataclass(frozen=True)
class ExpiredLease:
    """A running task the campaign saw with a lapsed lease, and the last time it still saw it so."""

    task_id: uuid.UUID
    lease_expires_at: datetime
    last_seen: datetime


@dataclass(frozen=True)
class RunningLease:
    """A task running just before a PostgreSQL fault: the attempt that owned it, and its lease."""

    task_id: uuid.UUID
    token: uuid.UUID
    lease_expires_at: datetime


@dataclass(frozen=True)
class PostgresOutage:
    """A PostgreSQL fault of the campaign: ``kind`` is ``pause`` or ``restart``; ``down_at`` is
    PostgreSQL's clock just before it, ``up_at`` its first answer afterwards (None: never), and
    ``recovered_at`` the moment recovery worked again (a reconcile ran after ``up_at``: workers
    stuck in calls to the stopped server had given up, as after a Redis outage)."""

    kind: str
    down_at: datetime
    up_at: datetime | None
    running: tuple[RunningLease, ...] = ()
    recovered_at: datetime | None = None

    @property
    def over_at(self) -> datetime | None:
        return self.recovered_at or self.up_at


@dataclass
class Observations:
    """What the campaign saw while it ran (all times PostgreSQL's clock)."""

    window_start: datetime
    window_end: datetime
    # The transport was down from the first instant to the second (the chain beat -> Redis ->
    # worker -> reconcile was seen working again); recovery bounds restart from the second.
    outages: list[tuple[datetime, datetime | None]] = field(default_factory=list)
    expired_leases: list[ExpiredLease] = field(default_factory=list)
    # Intervals during which due pending tasks waited, capacity was free and nothing was claimed.
    stalls: list[tuple[datetime, datetime]] = field(default_factory=list)
    max_running_seen: int = 0
    # Node names of workers run with a skewed clock, and the skew.
    skewed_workers: list[str] = field(default_factory=list)
    skew_seconds: float = 0.0
    # Cluster-wide counter dtask_fenced_writes_rejected by write kind (summed over Redis restarts).
    rejected_writes: dict[str, float] = field(default_factory=dict)
    # "lease lost before its terminal write" lines in the workers' logs.
    lease_lost_log_lines: int = 0
    # PostgreSQL paused or restarted (--own-postgres only). Like transport outages, they move
    # recovery deadlines: nothing can be reconciled before the database answers again.
    postgres_outages: list[PostgresOutage] = field(default_factory=list)
    # (PostgreSQL's clock, node) of every SIGKILL or SIGSTOP of a worker.
    worker_faults: list[tuple[datetime, str]] = field(default_factory=list)

    def outage_windows(self) -> list[tuple[datetime, datetime | None]]:
        """Every interval during which recovery could not proceed: transport and database outages."""
        return [*self.outages, *((o.down_at, o.over_at) for o in self.postgres_outages)]


@dataclass
class Snapshot:
    tasks: list[Row]
    attempts: list[Row]
    effects: list[Row]
    runs: list[Row]


@dataclass
class Finding:
    invariant: str
    title: str
    count: int
    checked: str
    details: dict[str, Any] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Report:
    findings: list[Finding]
    rejected_writes: dict[str, float]
    lease_lost_log_lines: int
    summary: dict[str, Any]

    @property
    def rejected_total(self) -> int:
        return int(sum(self.rejected_writes.values()))

    @property
    def fencing_exercised(self) -> bool:
        return self.rejected_total > 0

    @property
    def violations(self) -> int:
        return sum(f.count for f in self.findings)

    @property
    def ok(self) -> bool:
        return self.violations == 0 and self.fencing_exercised

    def counts(self) -> dict[str, int]:
        return {f.invariant: f.count for f in self.findings}

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "violations": self.violations,
            "invariants": {f.invariant: _jsonable(asdict(f)) for f in self.findings},
            "fencing": {
                "rejected_late_writes": self.rejected_total,
                "by_write": self.rejected_writes,
                "lease_lost_log_lines": self.lease_lost_log_lines,
                "exercised": self.fencing_exercised,
            },
            "summary": _jsonable(self.summary),
        }

    def table(self) -> str:
        rows = [(f.invariant, str(f.count), f.title, f.checked) for f in self.findings]
        by_write = ", ".join(f"{k} {int(v)}" for k, v in sorted(self.rejected_writes.items())) or "none"
        rows.append((
            "fencing", str(self.rejected_total), "late writes attempted and rejected (must be > 0)",
            f"{by_write}; {self.lease_lost_log_lines} 'lease lost' log lines",
        ))
        widths = [max(len(r[i]) for r in [*rows, ("check", "count", "what", "checked")]) for i in range(3)]
        head = ("check", "count", "what", "checked")
        lines = ["  ".join(h.ljust(w) for h, w in zip(head[:3], widths, strict=True)) + "  " + head[3]]
        lines.append("-" * (sum(widths) + 6 + 40))
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
        verdict = "PASS" if self.ok else "FAIL"
        why = []
        broken = sum(f.count for f in self.findings if f.invariant.startswith("I"))
        if broken:
            why.append(f"{broken} invariant violation(s)")
        if self.violations - broken:
            why.append(f"{self.violations - broken} running task(s) ended by a short PostgreSQL restart")
        if not self.fencing_exercised:
            why.append("no late write was rejected: fencing was not exercised")
        lines.append(f"{verdict}" + (f": {'; '.join(why)}" if why else ""))
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=_default))


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID | timedelta):
        return str(value)
    if isinstance(value, set | tuple):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


# ------------------------------------------------------------------------------------------ loading


async def load_snapshot(engine: AsyncEngine) -> Snapshot:
    """Everything the checks read, straight from the tables."""
    async with engine.connect() as conn:

        async def rows(sql: str) -> list[Row]:
            return [dict(r) for r in (await conn.execute(text(sql))).mappings().all()]

        return Snapshot(
            tasks=await rows(
                """SELECT id, task_type, status, dedupe_key, attempt_token, attempt_count, lease_expires_at,
                          heartbeat_at, cancel_requested_at, error, created_at, started_at, finished_at,
                          run_at
                   FROM tasks"""
            ),
            attempts=await rows(
                "SELECT task_id, attempt, token, worker, claimed_at, ended_at, outcome FROM task_attempts"
            ),
            effects=await rows(
                "SELECT id, task_id, attempt_token, step, created_at FROM diagnostics_effects"
            ),
            runs=await rows(
                "SELECT task_id, attempt_token, status, steps_done, hook, updated_at FROM diagnostics_runs"
            ),
        )


# ------------------------------------------------------------------------------------------ checks


def _attempt_end(attempt: Mapping[str, Any], window_end: datetime) -> datetime:
    end = attempt["ended_at"]
    return end if end is not None else window_end


def _brief(row: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: row.get(k) for k in keys}


def check_i1(snap: Snapshot, obs: Observations) -> Finding:
    """At most one attempt of a task holds a valid lease at any instant: the attempts of one task,
    each from its claim to its end (the terminal commit, or the lapsed lease of a dead owner), never
    overlap. The trail itself must be complete: one row per counted attempt, and no attempt of a
    finished task left open (either would hide an overlap)."""
    by_task: dict[Any, list[Row]] = defaultdict(list)
    for a in snap.attempts:
        by_task[a["task_id"]].append(a)
    status = {t["id"]: t for t in snap.tasks}
    overlaps: list[dict[str, Any]] = []
    open_after_end: list[dict[str, Any]] = []
    trail_mismatch: list[dict[str, Any]] = []
    for task_id, attempts in by_task.items():
        attempts.sort(key=lambda a: (a["claimed_at"], a["attempt"]))
        for i, earlier in enumerate(attempts):
            for later in attempts[i + 1 :]:
                if later["claimed_at"] < _attempt_end(earlier, obs.window_end):
                    overlaps.append({
                        "task_id": task_id,
                        "earlier": _brief(earlier, "attempt", "worker", "claimed_at", "ended_at"),
                        "later": _brief(later, "attempt", "worker", "claimed_at", "ended_at"),
                    })
        task = status.get(task_id)
        if task is not None and task["status"] in TERMINAL:
            open_after_end += [
                {"task_id": task_id, **_brief(a, "attempt", "worker", "claimed_at")}
                for a in attempts if a["ended_at"] is None
            ]
    for task in snap.tasks:
        n = len(by_task.get(task["id"], []))
        if n != task["attempt_count"]:
            trail_mismatch.append({"task_id": task["id"], "attempt_count": task["attempt_count"], "rows": n})
    return Finding(
        "I1", "overlapping valid leases of one task",
        len(overlaps) + len(open_after_end) + len(trail_mismatch),
        f"{len(snap.attempts)} attempts of {len(by_task)} tasks",
        {"overlapping_pairs": len(overlaps), "open_attempts_of_finished_tasks": len(open_after_end),
         "trail_mismatches": len(trail_mismatch),
         "tasks_with_several_attempts": sum(1 for a in by_task.values() if len(a) > 1)},
        (overlaps + open_after_end + trail_mismatch)[:EXAMPLES],
    )


def check_i2(snap: Snapshot, obs: Observations) -> Finding:
    """No write from a non-owner was committed: every effect row carries the token of an attempt of
    its own task and was written between that attempt's claim and its end; every domain row names
    (if anyone) an attempt of its own task."""
    by_token = {a["token"]: a for a in snap.attempts}
    foreign: list[dict[str, Any]] = []
    outside: list[dict[str, Any]] = []
    for e in snap.effects:
        attempt = by_token.get(e["attempt_token"])
        if attempt is None or attempt["task_id"] != e["task_id"]:
            foreign.append(_brief(e, "id", "task_id", "attempt_token", "step", "created_at"))
        elif not attempt["claimed_at"] <= e["created_at"] <= _attempt_end(attempt, obs.window_end):
            outside.append({
                **_brief(e, "id", "task_id", "step", "created_at"),
                "attempt": _brief(attempt, "attempt", "worker", "claimed_at", "ended_at"),
            })
    foreign_runs = []
    for r in snap.runs:
        token = r["attempt_token"]
        if token is None:
            continue
        attempt = by_token.get(token)
        if attempt is None or attempt["task_id"] != r["task_id"]:
            foreign_runs.append(_brief(r, "task_id", "attempt_token", "status"))
    late_attempts = {
        (o["attempt"]["worker"], o["attempt"]["attempt"], str(o["task_id"])) for o in outside
    }
    return Finding(
        "I2", "committed writes from a non-owner", len(foreign) + len(outside) + len(foreign_runs),
        f"{len(snap.effects)} effect rows, {len(snap.runs)} domain rows",
        {"effects_with_foreign_token": len(foreign), "effects_outside_their_attempt": len(outside),
         "domain_rows_with_foreign_token": len(foreign_runs),
         "attempts_with_late_effects": len(late_attempts),
         "effects_by_attempts_that_later_lost_their_lease": sum(
             1 for e in snap.effects
             if (a := by_token.get(e["attempt_token"])) is not None and a["outcome"] == "lease_expired"
         )},
        (foreign + outside + foreign_runs)[:EXAMPLES],
    )


def recovery_deadline(since: datetime, seconds: float, obs: Observations) -> datetime:
    """``since`` + ``seconds``, where time the transport or PostgreSQL spent down (and reconnecting)
    does not count: an outage that begins before the deadline moves the start to the moment it was
    over (a lease that lapsed during or just before a database pause cannot be reconciled before
    the database answers again)."""
    start = since
    for down, up in sorted(obs.outage_windows(), key=lambda o: o[0]):
        back = up if up is not None else obs.window_end
        if down <= start + timedelta(seconds=seconds) and back > start:
            start = back
    return start + timedelta(seconds=seconds)


def _outside_outages(start: datetime, end: datetime, obs: Observations) -> list[tuple[datetime, datetime]]:
    """The parts of [start, end] when the transport and PostgreSQL were up (and not reconnecting)."""
    parts = [(start, end)]
    for down, up in obs.outage_windows():
        back = up if up is not None else obs.window_end
        nxt: list[tuple[datetime, datetime]] = []
        for s, e in parts:
            if back <= s or down >= e:
                nxt.append((s, e))
                continue
            if s < down:
                nxt.append((s, down))
            if back < e:
                nxt.append((back, e))
        parts = nxt
    return parts


def check_i3(snap: Snapshot, obs: Observations, bounds: Bounds) -> Finding:
    """Every task reaches a terminal state, or runs: (a) none is left unfinished at the end;
    (b) a lapsed lease is converged (failed, or back to pending for a retry-safe handler) within
    ``recovery_seconds`` of its end, outages of the transport and of PostgreSQL excepted; (c) no due
    pending task waits, with capacity free and no claim anywhere, longer than the publish bound."""
    unfinished = [_brief(t, "id", "task_type", "status", "attempt_count") for t in snap.tasks
                  if t["status"] in ACTIVE]
    late: dict[Any, dict[str, Any]] = {}
    # The longest a lapsed lease stayed unconverged (to the last sight of it, or to the task's end),
    # and the least time to spare before its deadline: how close the run came to the bound.
    longest_lag = 0.0
    least_spare: float | None = None
    closest: dict[str, Any] = {}

    def judge(task_id: Any, lease_end: datetime, until: datetime, deadline: datetime) -> None:
        nonlocal longest_lag, least_spare, closest
        longest_lag = max(longest_lag, (until - lease_end).total_seconds())
        spare = (deadline - until).total_seconds()
        if least_spare is None or spare < least_spare:
            least_spare = spare
            closest = {"task_id": task_id, "lease_expires_at": lease_end, "converged_or_seen_at": until,
                       "deadline": deadline}

    for seen in obs.expired_leases:
        deadline = recovery_deadline(seen.lease_expires_at, bounds.recovery_seconds, obs)
        judge(seen.task_id, seen.lease_expires_at, seen.last_seen, deadline)
        if seen.last_seen > deadline:
            late[(seen.task_id, seen.lease_expires_at)] = {
                "task_id": seen.task_id, "lease_expires_at": seen.lease_expires_at,
                "still_running_at": seen.last_seen, "deadline": deadline,
                "late_seconds": round((seen.last_seen - deadline).total_seconds(), 3),
            }
    by_task: dict[Any, list[Row]] = defaultdict(list)
    for a in snap.attempts:
        by_task[a["task_id"]].append(a)
    converged = 0
    for task in snap.tasks:
        error = task["error"] or {}
        if task["status"] not in TERMINAL or error.get("code") != "lease_expired" or not by_task[task["id"]]:
            continue
        last = max(by_task[task["id"]], key=lambda a: a["attempt"])
        if last["ended_at"] is None or task["finished_at"] is None:
            continue
        converged += 1
        deadline = recovery_deadline(last["ended_at"], bounds.recovery_seconds, obs)
        judge(task["id"], last["ended_at"], task["finished_at"], deadline)
        if task["finished_at"] > deadline:
            late.setdefault((task["id"], last["ended_at"]), {
                "task_id": task["id"], "lease_expires_at": last["ended_at"],
                "finished_at": task["finished_at"], "deadline": deadline,
                "late_seconds": round((task["finished_at"] - deadline).total_seconds(), 3),
            })
    stalls = []
    longest = 0.0
    for start, end in obs.stalls:
        for s, e in _outside_outages(start, end, obs):
            seconds = (e - s).total_seconds()
            longest = max(longest, seconds)
            if seconds > bounds.stall_seconds:
                stalls.append({"from": s, "to": e, "seconds": round(seconds, 3)})
    expired_seen = len({s.task_id for s in obs.expired_leases})
    return Finding(
        "I3", "tasks not terminal / not recovered within the bound",
        len(unfinished) + len(late) + len(stalls),
        f"{len(snap.tasks)} tasks; {expired_seen} tasks seen with a lapsed lease, {converged} failed "
        f"lease_expired; bound {bounds.recovery_seconds:.1f} s after a lease ends, "
        f"{bounds.stall_seconds:g} s for a due task with free capacity"
        + _outage_note(obs),
        {"not_terminal": len(unfinished), "converged_late": len(late), "pending_stalls": len(stalls),
         "longest_stall_seconds": round(longest, 3),
         "recovery_bound_seconds": round(bounds.recovery_seconds, 3),
         "longest_unconverged_lease_seconds": round(longest_lag, 3),
         "least_seconds_to_spare": None if least_spare is None else round(least_spare, 3),
         "closest_call": closest,
         "stall_bound_seconds": bounds.stall_seconds, "outages": len(obs.outages),
         "postgres_outages": len(obs.postgres_outages),
         "postgres_outage_seconds": round(sum(
             ((o.up_at or obs.window_end) - o.down_at).total_seconds() for o in obs.postgres_outages
         ), 3),
         "postgres_recovery_seconds": [
             round((o.over_at - o.down_at).total_seconds(), 3) if o.over_at else None
             for o in obs.postgres_outages
         ]},
        (unfinished + list(late.values()) + stalls)[:EXAMPLES],
    )


def _outage_note(obs: Observations) -> str:
    if not obs.outages and not obs.postgres_outages:
        return ""
    return (f"; deadlines moved past {len(obs.outages)} transport and {len(obs.postgres_outages)} "
            "PostgreSQL outage(s), which recovery has to wait out")


def check_schedule(snap: Snapshot) -> Finding:
    """No attempt was claimed before the instant its task was submitted for (run_at)."""
    run_at = {t["id"]: t.get("run_at") for t in snap.tasks}
    scheduled = [a for a in snap.attempts if run_at.get(a["task_id"]) is not None]
    early = [
        {"task_id": a["task_id"], "attempt": a["attempt"], "claimed_at": a["claimed_at"],
         "run_at": run_at[a["task_id"]]}
        for a in scheduled if a["claimed_at"] < run_at[a["task_id"]]
    ]  # fmt: skip
    return Finding(
        "schedule", "attempts claimed before their task's run_at", len(early),
        f"{len(scheduled)} attempts of {sum(1 for v in run_at.values() if v is not None)} scheduled tasks",
        {"early": len(early), "scheduled_attempts": len(scheduled)},
        early[:EXAMPLES],
    )


def check_i4(snap: Snapshot) -> Finding:
    """At most one active task per (type, dedupe key): the lifetimes [created_at, finished_at) of
    the tasks sharing a key never overlap (an unfinished task's lifetime has no end)."""
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for t in snap.tasks:
        if t["dedupe_key"] is not None:
            groups[(t["task_type"], t["dedupe_key"])].append(t)
    pairs: list[dict[str, Any]] = []
    for (task_type, key), rows in groups.items():
        rows.sort(key=lambda t: (t["created_at"], str(t["id"])))
        for i, earlier in enumerate(rows):
            for later in rows[i + 1 :]:
                if earlier["finished_at"] is None or later["created_at"] < earlier["finished_at"]:
                    pairs.append({
                        "task_type": task_type, "dedupe_key": key,
                        "earlier": _brief(earlier, "id", "created_at", "finished_at", "status"),
                        "later": _brief(later, "id", "created_at", "finished_at", "status"),
                    })
    reused = sum(1 for rows in groups.values() if len(rows) > 1)
    return Finding(
        "I4", "dedupe keys held by two active tasks at once", len(pairs),
        f"{sum(len(r) for r in groups.values())} tasks on {len(groups)} keys ({reused} keys reused)",
        {"overlapping_pairs": len(pairs), "keys": len(groups), "keys_reused": reused},
        pairs[:EXAMPLES],
    )


def check_i5(snap: Snapshot, obs: Observations, bounds: Bounds) -> Finding:
    """Running tasks never exceed the capacity: the most attempts alive at one instant, over the
    whole trail (an attempt ending when another starts does not overlap it), and the most running
    rows the campaign ever saw."""
    events = sorted(
        [(a["claimed_at"], 1, a) for a in snap.attempts]
        + [(_attempt_end(a, obs.window_end), -1, a) for a in snap.attempts],
        key=lambda ev: (ev[0], ev[1]),
    )
    live = peak = 0
    peak_at: datetime | None = None
    excess: list[dict[str, Any]] = []
    for at, delta, attempt in events:
        live += delta
        if live > peak:
            peak, peak_at = live, at
        if delta == 1 and live > bounds.capacity:
            excess.append({"claimed_at": at, "live": live, **_brief(attempt, "task_id", "worker", "attempt")})
    over_seen = max(0, obs.max_running_seen - bounds.capacity)
    return Finding(
        "I5", "claims beyond the cluster-wide capacity", len(excess) + over_seen,
        f"{len(snap.attempts)} attempts; peak {peak} live at once, {obs.max_running_seen} running rows "
        f"seen at most; capacity {bounds.capacity}",
        {"peak_live_attempts": peak, "peak_at": peak_at, "max_running_rows_seen": obs.max_running_seen,
         "capacity": bounds.capacity, "claims_over_capacity": len(excess)},
        excess[:EXAMPLES],
    )


def check_i6(snap: Snapshot) -> Finding:
    """No domain row stays in progress once its task is terminal."""
    status = {t["id"]: t["status"] for t in snap.tasks}
    stuck = [
        {**_brief(r, "task_id", "status", "steps_done", "hook"), "task_status": status.get(r["task_id"])}
        for r in snap.runs if r["status"] == "running" and status.get(r["task_id"]) in TERMINAL
    ]
    by_status = Counter(r["status"] for r in snap.runs)
    spread = ", ".join(f"{k} {v}" for k, v in sorted(by_status.items()))
    return Finding(
        "I6", "domain rows left in progress after their task ended", len(stuck),
        f"{len(snap.runs)} diagnostics_runs rows ({spread})",
        {"running_with_terminal_task": len(stuck), "runs_by_status": dict(by_status)},
        stuck[:EXAMPLES],
    )


_STAMPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tasks", ("created_at", "started_at", "finished_at", "heartbeat_at")),
    ("attempts", ("claimed_at", "ended_at")),
    ("effects", ("created_at",)),
    ("runs", ("updated_at",)),
)


def check_i7(snap: Snapshot, obs: Observations) -> Finding:
    """Worker clocks do not matter. Every lease and attempt time is written by PostgreSQL's
    ``clock_timestamp()`` (repository.py never sends a worker's time), so every stored timestamp
    must fall inside the campaign's window as PostgreSQL measured it. A worker run with a skewed
    clock (libfaketime) would leave stamps an hour off if its clock were ever used; its attempts
    must look like everyone else's."""
    outside: list[dict[str, Any]] = []
    checked = 0
    for table, columns in _STAMPS:
        for row in getattr(snap, table):
            for column in columns:
                value = row.get(column)
                if value is None:
                    continue
                checked += 1
                if not obs.window_start <= value <= obs.window_end:
                    outside.append({"table": table, "column": column, "value": value,
                                    "row": str(row.get("id") or row.get("task_id"))})
    skewed = [a for a in snap.attempts
              if a["worker"] and any(a["worker"].startswith(f"{node}:") for node in obs.skewed_workers)]
    outcomes = Counter(a["outcome"] for a in skewed)
    if obs.skewed_workers:
        how = (f"{len(skewed)} attempts by a worker whose clock was {obs.skew_seconds:+g} s off "
               f"({outcomes.get('success', 0)} succeeded)")
    else:
        how = "no skewed worker ran (libfaketime not found or skew 0): window check only"
    return Finding(
        "I7", "timestamps not from PostgreSQL's clock", len(outside),
        f"{checked} stored timestamps inside [campaign start, end] by PostgreSQL's clock; {how}",
        {"timestamps_checked": checked, "outside_window": len(outside),
         "skewed_workers": obs.skewed_workers, "skew_seconds": obs.skew_seconds,
         "skewed_attempts": len(skewed), "skewed_attempt_outcomes": dict(outcomes),
         "skew_exercised": bool(skewed)},
        outside[:EXAMPLES],
    )


# Task types whose handler fails on purpose: they never end success, restart or not.
FAILS_ON_PURPOSE = frozenset({"diagnostics.fail"})


def _worker_node(attempt: Mapping[str, Any]) -> str:
    return str(attempt["worker"] or "").rsplit(":", 1)[0]


def _not_counted(
    lease: RunningLease, restart: PostgresOutage, snap_tasks: Mapping[Any, Row],
    attempts: Mapping[Any, Row], obs: Observations, bounds: Bounds,
) -> str | None:
    """Why a task running at ``restart`` is not held to the promise (None: it is)."""
    assert restart.up_at is not None
    task, attempt = snap_tasks.get(lease.task_id), attempts.get(lease.token)
    if task is None or attempt is None:
        return "no_attempt_record"
    if lease.lease_expires_at <= restart.up_at:
        return "lease_shorter_than_the_downtime"
    if task["task_type"] in FAILS_ON_PURPOSE:
        return "fails_on_purpose"
    if task["cancel_requested_at"] is not None:
        return "cancel_requested"
    start, end = attempt["claimed_at"], attempt["ended_at"] or obs.window_end
    node = _worker_node(attempt)
    if any(name == node and start <= at <= end for at, name in obs.worker_faults):
        return "owner_killed_or_paused"
    for other in obs.postgres_outages:
        if other is restart or not restart.down_at < other.down_at < end:
            continue
        if other.kind != "restart":
            return "database_paused_later"
        later = next((r for r in other.running if r.token == lease.token), None)
        survivable = later is not None and other.up_at is not None and not _not_counted(
            later, other, snap_tasks, attempts, obs, bounds
        )
        if not survivable:
            return "later_restart_not_survivable"
    # Last, so that a near miss is one for no other reason: the lease outlived the downtime, but by
    # less than a worker may wait between two tries; whether it made it is luck, not the promise.
    if lease.lease_expires_at <= restart.up_at + timedelta(seconds=bounds.retry_gap_seconds):
        return "lease_within_the_retry_gap"
    return None


def check_restart_survival(snap: Snapshot, obs: Observations, bounds: Bounds) -> Finding:
    """Issue 14: after a PostgreSQL restart shorter than the remaining lease, the tasks that were
    running at the restart end ``success`` on the attempt that was running (attempt 1, unless a
    retry-safe task was already on a later one). Held to it: tasks running just before the restart
    whose lease outlasted the downtime by the workers' retry gap. Not counted: tasks whose lease
    could not survive the downtime, that fail on purpose, were cancelled, or whose owner another
    fault hit (a worker killed or paused, a later database pause or an unsurvivable restart)."""
    restarts = [o for o in obs.postgres_outages if o.kind == "restart"]
    tasks = {t["id"]: t for t in snap.tasks}
    attempts = {a["token"]: a for a in snap.attempts}
    judged: set[Any] = set()
    survived = 0
    lost: list[dict[str, Any]] = []
    not_counted: Counter[str] = Counter()
    near_misses: Counter[str] = Counter()

    def ended_well(lease: RunningLease) -> bool:
        return bool(tasks[lease.task_id]["status"] == "success" == attempts[lease.token]["outcome"])

    for restart in restarts:
        for lease in restart.running:
            if lease.token in judged:
                continue  # held to the promise at an earlier restart already
            reason = "never_came_back" if restart.up_at is None else _not_counted(
                lease, restart, tasks, attempts, obs, bounds
            )
            if reason is not None:
                not_counted[reason] += 1
                if reason == "lease_within_the_retry_gap":
                    near_misses["survived" if ended_well(lease) else "ended"] += 1
                continue
            judged.add(lease.token)
            task, attempt = tasks[lease.task_id], attempts[lease.token]
            if ended_well(lease):
                survived += 1
                continue
            assert restart.up_at is not None
            lost.append({
                "task_id": lease.task_id, "task_type": task["task_type"], "status": task["status"],
                "error": task["error"], "attempt": attempt["attempt"], "outcome": attempt["outcome"],
                "worker": attempt["worker"], "restart_down_at": restart.down_at,
                "restart_up_at": restart.up_at, "lease_expires_at": lease.lease_expires_at,
                "lease_left_after_restart_seconds": round(
                    (lease.lease_expires_at - restart.up_at).total_seconds(), 3),
            })
    downtimes = [round((r.up_at - r.down_at).total_seconds(), 2) for r in restarts if r.up_at is not None]
    eligible = survived + len(lost)
    if restarts:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(not_counted.items())) or "none"
        checked = (f"{len(restarts)} restarts (down {', '.join(f'{d:g}' for d in downtimes)} s): "
                   f"{survived} of {eligible} tasks whose lease outlived the downtime ended success on "
                   f"the same attempt; not counted: {skipped}")
    else:
        checked = "no PostgreSQL restart in this campaign (only with --own-postgres)"
    return Finding(
        "restart", "running tasks a short PostgreSQL restart ended (must end success)", len(lost),
        checked,
        {"restarts": len(restarts), "downtime_seconds": downtimes, "eligible": eligible,
         "survived": survived, "did_not_survive": len(lost), "not_counted": dict(not_counted),
         "near_misses": {"survived": near_misses["survived"], "ended": near_misses["ended"]},
         "retry_gap_seconds": bounds.retry_gap_seconds},
        lost[:EXAMPLES],
    )


def summarize(snap: Snapshot) -> dict[str, Any]:
    statuses = Counter(t["status"] for t in snap.tasks)
    codes = Counter((t["error"] or {}).get("code") for t in snap.tasks if t["error"])
    types = Counter(t["task_type"] for t in snap.tasks)
    outcomes = Counter(a["outcome"] for a in snap.attempts)
    by_type: dict[str, dict[str, int]] = defaultdict(dict)
    for (task_type, code), n in Counter(
        (t["task_type"], (t["error"] or {}).get("code")) for t in snap.tasks if t["error"]
    ).items():
        by_type[task_type][str(code)] = n
    # Failures the workload did not ask for (diagnostics.fail raises on purpose; lease_expired and
    # cancelled are the faults' doing): what a dropped connection or a broken hook cost.
    other = [
        {"task_type": t["task_type"], "code": t["error"].get("code"),
         "message": str(t["error"].get("message"))[:200]} for t in snap.tasks
        if t["error"] and t["task_type"] != "diagnostics.fail"
        and (t["error"] or {}).get("code") not in ("lease_expired", "cancelled")
    ]
    return {
        "tasks": len(snap.tasks),
        "tasks_by_status": dict(statuses),
        "tasks_by_type": dict(types),
        "error_codes": dict(codes),
        "error_codes_by_type": dict(by_type),
        "unexpected_failures": len(other),
        "unexpected_failure_examples": other[:EXAMPLES],
        "attempts": len(snap.attempts),
        "attempt_outcomes": {str(k): v for k, v in outcomes.items()},
        "retried_tasks": sum(1 for t in snap.tasks if t["attempt_count"] > 1),
        "effects": len(snap.effects),
        "dedupe_tasks": sum(1 for t in snap.tasks if t["dedupe_key"] is not None),
    }


def check(snap: Snapshot, obs: Observations, bounds: Bounds) -> Report:
    findings = [
        check_i1(snap, obs),
        check_i2(snap, obs),
        check_i3(snap, obs, bounds),
        check_i4(snap),
        check_i5(snap, obs, bounds),
        check_i6(snap),
        check_i7(snap, obs),
        check_restart_survival(snap, obs, bounds),
        check_schedule(snap),
    ]
    return Report(findings, dict(obs.rejected_writes), obs.lease_lost_log_lines, summarize(snap))


def merge_counts(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for part in parts:
        for key, value in part.items():
            total[key] += value
    return dict(total)
