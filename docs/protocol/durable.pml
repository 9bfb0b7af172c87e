/*
 * The durable-task ownership protocol (claim, lease, fenced writes, cancel, reconcile, relay) as a
 * Promela model, checked by spin.
 * docs/protocol/README.md says what each bound covers and what the checks found;
 * scripts/check-protocol runs every configuration.
 *
 * One row per task, as tasks_core/store writes it: status, attempt token, attempt count,
 * lease, cancel intent, the row lock of an open owning/terminal transaction, the domain row its
 * handler writes, and the capacity slots (task_slots). Each atomic block below is one SQL
 * statement or one committed transaction of the repository; the comment names the function.
 *
 * Time. Only PostgreSQL's clock decides a lease (I7). The model keeps, per task, whether the
 * current lease is still in the future of the database clock (live) or not; the Clock process
 * moves the database clock past a lease at any moment, and nothing ever moves it back: an
 * expired lease is never live again (a renewal is fenced on `lease_expires_at > now`, so it
 * cannot revive one), only a new claim makes a new, live lease. Worker clocks appear nowhere: a
 * worker decides to write, heartbeat, time out or shut down at arbitrary moments, as a worker
 * with a wrong clock (or paused, or partitioned) would, and only the fenced statements decide.
 *
 * Bounds (overridable with spin -DNAME=value): 2 tasks (fixed), W claimers, capacity C, MAXATT
 * attempts for the retry-safe task 0 (task 1 is not retry-safe), MAXDUP broker duplicates,
 * MAXLOSS lost messages, STEPS handler actions per attempt, SHARED_KEY: both tasks share one
 * dedupe key of one owner.
 *
 * Mutants (scripts/check-protocol --mutants; each must make a check fail):
 *   MUT_OTX_NO_RECHECK   the owning transaction commits without re-checking the lease
 *   MUT_REPORT_NO_TOKEN  the progress report's fence omits the attempt token
 *   MUT_CLAIM_NO_SLOT    the claim ignores the capacity slots
 *   MUT_CONVERGE_NO_HOOK the reconciler ends a task without its failure hook
 *   MUT_FINISH_NO_CANCEL the owner's success ignores cancel intent
 *   MUT_RECONCILE_NO_PENDING_CANCEL  the reconciler leaves a pending row with cancel intent
 *   MUT_NO_REPUBLISH     nothing re-sends a lost message (no periodic publisher)
 *   MUT_CLAIM_BEFORE_DUE the claim ignores the task's instant (run_at, or a retry's backoff)
 *   MUT_CLAIM_WHILE_PAUSED the claim ignores a paused type
 */

#ifndef W
#define W 3
#endif
#ifndef C
#define C 1
#endif
#ifndef MAXATT
#define MAXATT 2
#endif
#ifndef MAXMSG
#define MAXMSG 2
#endif
#ifndef MAXDUP
#define MAXDUP 2
#endif
#ifndef MAXLOSS
#define MAXLOSS 1
#endif
#ifndef STEPS
#define STEPS 2
#endif
#ifndef MESSAGES
#define MESSAGES 1
#endif
#ifndef SHARED_KEY
#define SHARED_KEY 0
#endif
/* task 1 is submitted with a run_at in the future (delay_seconds / run_at) */
#ifndef SCHEDULED
#define SCHEDULED 1
#endif

#define T 2
/* task 1's type may be paused by an operator (paused_types), then resumed */
#ifndef PAUSABLE
#define PAUSABLE 0
#endif

/* task status (tasks.status); NONE = not inserted yet */
#define NONE      0
#define PENDING   1
#define RUNNING   2
#define SUCCESS   3
#define FAILED    4
#define CANCELLED 5
#define TERMINAL(t) (st[t] >= SUCCESS)
#define ACTIVE(t)   (st[t] == PENDING || st[t] == RUNNING)

/* the domain row a handler creates (diagnostics_runs, knowledge_files...) */
#define D_NONE 0
#define D_INPROGRESS 1
#define D_DONE 2
#define D_ERROR 3

#define RETRY_SAFE(t) ((t) == 0)

byte st[T];            /* status */
byte tok[T];           /* attempt_token: the attempt number that owns it, 0 = NULL */
byte att[T];           /* attempt_count */
bool live[T];          /* lease_expires_at > database now */
bool cxl[T];           /* cancel_requested_at IS NOT NULL */
bool due[T];           /* not_before <= database now: its run_at, or a retry's backoff, has passed */
bool paused;           /* task 1's type is in paused_types */
#define PAUSED(t) ((t) == 1 && paused)
#define SENDABLE(t) (st[t] == PENDING && !cxl[t] && due[t] && !PAUSED(t))
byte lk[T];            /* row lock held by an open transaction of worker lk-1; 0 = none */
byte dom[T];           /* the task's domain row */
byte msgs[T];          /* task-id messages on the broker (a bag: any order, any delay) */
byte slot[C];          /* task_slots.task_id: t+1, 0 = free */
byte slottok[C];       /* task_slots.token */
byte dups;             /* broker duplicates so far */
byte losses;           /* lost messages so far (when MAXLOSS bounds them) */

/* ghosts: facts the invariants read, never the protocol */
byte open[T];          /* attempts claimed and not ended (task_attempts.ended_at IS NULL) */
byte terms[T];         /* committed terminal transitions */
bool creq[T];          /* cancel intent arrived while the task was running */
bool ownerend[T];      /* the terminal transition was the owner's own (finish) */
bool submitted[T];
#ifdef MUT_NO_REPUBLISH
bool sent[T];
#endif

/* ------------------------------------------------------------------ invariants */

/* I1: at most one open attempt, and it is the row's token (so at most one holds a lease);
 * I5: running tasks never exceed C, and the slots hold exactly the running tasks' tokens;
 * I4: one active task per dedupe key; I6: no domain row in progress under a terminal task. */
inline check() {
  assert(open[0] <= 1 && open[1] <= 1);
  assert((st[0] == RUNNING) == (open[0] == 1) && (st[1] == RUNNING) == (open[1] == 1));
  assert((st[0] == RUNNING) + (st[1] == RUNNING) <= C);
  assert(!SHARED_KEY || ACTIVE(0) + ACTIVE(1) <= 1);
  assert(!TERMINAL(0) || dom[0] != D_INPROGRESS);
  assert(!TERMINAL(1) || dom[1] != D_INPROGRESS);
  c = 0;
  do
  :: c < C ->
     assert(slot[c] == 0 || (st[slot[c] - 1] == RUNNING && tok[slot[c] - 1] == slottok[c]));
     c++
  :: else -> break
  od;
  assert(st[0] != RUNNING || (slot[0] == 1 && slottok[0] == tok[0]) || (C > 1 && slot[C - 1] == 1 && slottok[C - 1] == tok[0]));
  assert(st[1] != RUNNING || (slot[0] == 2 && slottok[0] == tok[1]) || (C > 1 && slot[C - 1] == 2 && slottok[C - 1] == tok[1]));
  c = 0
}

/* the fence of every owner write (OWNED in repository.py) */
#define OWNED(t) (tok[t] == mytok && st[t] == RUNNING && live[t])

/* I2: the writer is the current owner of an unexpired lease at the instant its write commits */
#define I2(t, mytok) assert(tok[t] == (mytok) && st[t] == RUNNING && live[t])

/* a transition out of running: the attempt ends, its slot is given back (FINISH_SQL's `ended`
 * and `freed`, _end_attempt and FREE_SLOT_SQL) */
inline end_attempt(t) {
  open[t]--;
  c = 0;
  do
  :: c < C && slot[c] == t + 1 -> slot[c] = 0; slottok[c] = 0; c++
  :: c < C && slot[c] != t + 1 -> c++
  :: else -> break
  od;
  c = 0;
  tok[t] = 0;
  live[t] = 0
}

/* a terminal transition (status, dedupe key released with it) plus the type's hook, which
 * converges the domain row the task still owns */
inline terminal(t, s, hook) {
  assert(!TERMINAL(t));
  st[t] = s;
  terms[t]++;
  assert(terms[t] == 1);
  if
  :: hook && dom[t] == D_INPROGRESS -> dom[t] = (s == SUCCESS -> D_DONE : D_ERROR)
  :: else -> skip
  fi
}

/* relay.py: after a slot frees, the due pending tasks with no message in flight are sent */
inline relay() {
#if MESSAGES
  if
  :: SENDABLE(0) && msgs[0] == 0 -> msgs[0] = 1
  :: else -> skip
  fi;
  if
  :: SENDABLE(1) && msgs[1] == 0 -> msgs[1] = 1
  :: else -> skip
  fi
#else
  skip
#endif
}

/* ------------------------------------------------------------------ actors */

/* submission.py + TaskStore.insert: insert pending (ON CONFLICT on the active dedupe key:
 * refused while a holder is active), commit, then publish (which may fail: the publisher
 * re-sends). A dedupe submit may be retried until the key is free. */
active proctype Submitter() {
  byte t = 0;
  byte c;
  do
  :: t < T ->
     d_step {
       if
       :: !(SHARED_KEY && (ACTIVE(0) || ACTIVE(1))) ->
          st[t] = PENDING; submitted[t] = 1; due[t] = (t == 0 || !SCHEDULED); check();
          t++
       :: else -> skip      /* 409: the holder's id; the user may retry later */
       fi
     }
  :: t < T && SHARED_KEY -> t++          /* the user gives up on a refused duplicate */
  :: else -> break
  od
}

/* the first publish after commit, the periodic publisher (publisher.py: pending, no cancel
 * intent, no message in flight or one presumed lost) and the broker's own faults */
#if MESSAGES
active proctype Broker() {
  byte c;
end:
  do
  /* a task is sent once due and its type not paused, never ahead (no broker countdown) */
#ifdef MUT_NO_REPUBLISH
  /* only the submission's own publish: nothing re-sends a lost or dropped message */
  :: d_step { SENDABLE(0) && msgs[0] == 0 && !sent[0] -> msgs[0] = 1; sent[0] = 1 }
  :: d_step { SENDABLE(1) && msgs[1] == 0 && !sent[1] -> msgs[1] = 1; sent[1] = 1 }
#else
  :: d_step { SENDABLE(0) && msgs[0] == 0 -> msgs[0] = 1 }
  :: d_step { SENDABLE(1) && msgs[1] == 0 -> msgs[1] = 1 }
#endif
  /* duplicates, at most MAXDUP in a run: a broker that duplicated (or redelivered) a message
   * without end, and workers that always took that one, would starve the other task; a real
   * broker delivers roughly in order, which the model does not have */
  :: d_step { msgs[0] > 0 && msgs[0] < MAXMSG && dups < MAXDUP -> msgs[0]++; dups++ }
  :: d_step { msgs[1] > 0 && msgs[1] < MAXMSG && dups < MAXDUP -> msgs[1]++; dups++ }
#if MAXLOSS
  :: d_step { msgs[0] > 0 && losses < MAXLOSS -> msgs[0]--; losses++ } /* lost */
  :: d_step { msgs[1] > 0 && losses < MAXLOSS -> msgs[1]--; losses++ }
#endif
  od
}
#endif

/* The operator: pauses task 1's type at any moment, and resumes it later (paused_types; resume
 * also relays what waits). Running tasks are not touched. */
#if PAUSABLE
active proctype Operator() {
  byte c;
  atomic { paused = 1 };
  atomic { paused = 0; relay() }
}
#endif

/* The database clock passes a running task's lease (nobody renewed it in time: a paused,
 * partitioned or dead owner, or a slow heartbeat). It never moves back. The early expiry of a
 * dead process's attempts by their tokens (EXPIRE_ATTEMPTS_SQL) is this same step: it ends the
 * live lease of a running row at a moment of its choosing and changes nothing else. */
active proctype Clock() {
  byte c;
end:
  do
  :: d_step { st[0] == RUNNING && live[0] -> live[0] = 0; check() }
  :: d_step { st[1] == RUNNING && live[1] -> live[1] = 0; check() }
  /* ... and a pending task's instant (its run_at, or its retry backoff) */
  :: d_step { st[0] == PENDING && !due[0] -> due[0] = 1 }
  :: d_step { st[1] == PENDING && !due[1] -> due[1] = 1 }
  od
}

/* CLAIM_SQL, one statement: pending, no cancel intent, due (not_before passed), a free slot
 * below the capacity; the task runs under a new token and a live lease, the slot and the attempt
 * are taken. Refused: the message is acknowledged and dropped (the relay or the publisher
 * re-sends). */
inline claim(t) {
  ok = 0;
  if
#if defined(MUT_CLAIM_BEFORE_DUE)
  :: st[t] == PENDING && !cxl[t] && !PAUSED(t) ->
#elif defined(MUT_CLAIM_WHILE_PAUSED)
  :: st[t] == PENDING && !cxl[t] && due[t] ->
#else
  :: st[t] == PENDING && !cxl[t] && due[t] && !PAUSED(t) ->
#endif
     c = 0;
     do
     :: c < C && slot[c] == 0 -> break
     :: c < C && slot[c] != 0 -> c++
     :: else -> break
     od;
#ifdef MUT_CLAIM_NO_SLOT
     if :: c == C -> c = 0 :: else -> skip fi;
#endif
     if
     :: c < C ->
        assert(due[t]);                /* no attempt starts before its task's instant */
        assert(!PAUSED(t));            /* nor while its type is paused */
        st[t] = RUNNING; att[t]++; tok[t] = att[t]; live[t] = 1; open[t]++;
        slot[c] = t + 1; slottok[c] = tok[t];
        mytok = tok[t]; steps = 0; ok = 1
     :: else -> skip
     fi;
     c = 0
  :: else -> skip
  fi;
  if :: !ok -> t = 0 :: else -> skip fi;
  check()
}

/* TaskStore.finish: FINISH_SQL (fenced, locks the row), the type's hook in the same
 * transaction, the lease re-check, COMMIT. Cancel intent beats a concurrent success. */
inline finish(t, want) {
  if :: OWNED(t) -> skip :: else -> goto lost fi;
  if :: skip :: live[t] = 0 fi;        /* the clock may pass the lease while the hook runs */
  if
  :: live[t] ->
     I2(t, mytok);
     end_attempt(t);
#ifdef MUT_FINISH_NO_CANCEL
     terminal(t, want, 1);
#else
     terminal(t, (want == SUCCESS && cxl[t] -> CANCELLED : want), 1);
#endif
     ownerend[t] = 1;
     assert(!(cxl[t] && st[t] == SUCCESS));
     relay();
     check()
  :: else -> skip                      /* rolled back; the reconciler converges the row */
  fi
}

/* The user: TaskStore.request_cancel (locks the row, so waits for an open owning
 * transaction): pending -> cancelled at once with its hook; running -> cancel intent. */
active proctype Canceller() {
  byte t;
  byte c;
  do
  :: atomic {
       t < T && lk[t] == 0 && st[t] != NONE ->
       if
       :: st[t] == PENDING -> terminal(t, CANCELLED, 1); cxl[t] = 1
       :: st[t] == RUNNING -> cxl[t] = 1; creq[t] = 1
       :: else -> skip
       fi;
       check();
       t++
     }
  :: t < T -> t++          /* this task is never cancelled */
  :: else -> break
  od
}

/* TaskStore.reconcile: rows locked elsewhere are skipped (SKIP LOCKED); an expired
 * running row goes back to pending (retry-safe, attempts left, no cancel intent) or ends failed
 * (cancelled under cancel intent) with its failure hook; a pending row with cancel intent ends
 * cancelled with its hook. One transaction per task. */
inline reconcile_one(t) {
  if
  :: lk[t] == 0 && st[t] == RUNNING && !live[t] ->
     if
     :: RETRY_SAFE(t) && att[t] < MAXATT && !cxl[t] ->
        end_attempt(t); st[t] = PENDING; due[t] = 0   /* PENDING_SET: not before now + backoff */
     :: else ->
        end_attempt(t);
#ifdef MUT_CONVERGE_NO_HOOK
        terminal(t, (cxl[t] -> CANCELLED : FAILED), 0)
#else
        terminal(t, (cxl[t] -> CANCELLED : FAILED), 1)
#endif
     fi;
     /* under cancel intent the end is `cancelled`, whoever ends it */
     assert(!creq[t] || st[t] == CANCELLED || st[t] == PENDING);
     relay()
#ifndef MUT_RECONCILE_NO_PENDING_CANCEL
  :: lk[t] == 0 && st[t] == PENDING && cxl[t] ->
     terminal(t, CANCELLED, 1)
#endif
  :: else -> skip
  fi;
  check()
}

active proctype Reconciler() {
  byte c;
end:
  do
  :: d_step {
       ((lk[0] == 0 && ((st[0] == RUNNING && !live[0]) || (st[0] == PENDING && cxl[0]))) ||
        (lk[1] == 0 && ((st[1] == RUNNING && !live[1]) || (st[1] == PENDING && cxl[1])))) ->
       reconcile_one(0);
       reconcile_one(1)
     }
  od
}


/* A worker process: receives task ids, claims, runs the handler beside its heartbeat, writes
 * as the owner, ends the attempt (or loses it); it may die or pause at any point (a paused
 * worker is one that takes no step while the others, and the clock, go on).
 *
 * A transaction that holds the task's row lock (owning transaction, terminal write, hand-back)
 * is one atomic step: while it holds the lock, request_cancel waits, the reconciler skips the
 * row (SKIP LOCKED) and a claim needs a pending row, so only the clock can move, and the step
 * chooses whether the clock passed the lease during the callback (or a lock wait). */
proctype Worker(byte w) {
  byte t, mytok, steps, c;
  bool ok;
idle:
  skip;
end:
  do
#if MESSAGES
  :: atomic { msgs[0] > 0 -> t = 0; msgs[0]--; claim(t); if :: ok -> goto attempt :: else -> skip fi }
  :: atomic { msgs[1] > 0 -> t = 1; msgs[1]--; claim(t); if :: ok -> goto attempt :: else -> skip fi }
#else
  /* Without the broker: a claim of either task at any moment, i.e. every delivery a broker
   * could make (duplicate, late, out of order; a lost one is a claim never tried). Safety only. */
  :: atomic { st[0] == PENDING -> t = 0; claim(t); if :: ok -> goto attempt :: else -> skip fi }
  :: atomic { st[1] == PENDING -> t = 1; claim(t); if :: ok -> goto attempt :: else -> skip fi }
#endif
  od;

attempt:
  ok = 0;
  do
  :: atomic {              /* TaskContext.report: one fenced UPDATE */
       steps < STEPS -> steps++;
#ifdef MUT_REPORT_NO_TOKEN
       if :: st[t] == RUNNING && live[t] -> I2(t, mytok) :: else -> goto lost fi
#else
       if :: OWNED(t) -> I2(t, mytok) :: else -> goto lost fi
#endif
     }
  :: atomic {              /* heartbeat: fenced renewal (waits for the row lock), reads cancel */
       steps < STEPS && lk[t] == 0 -> steps++;
       if
       :: OWNED(t) && cxl[t] -> I2(t, mytok); goto cancelled
       :: OWNED(t) && !cxl[t] -> I2(t, mytok)
       :: else -> goto lost
       fi
     }
  :: atomic {              /* owning_transaction: lock the row as the live owner, callback, ... */
       steps < STEPS && lk[t] == 0 -> steps++;
       if :: OWNED(t) -> skip :: else -> goto lost fi;
       if :: skip :: live[t] = 0 fi;   /* ... the clock may pass the lease meanwhile ... */
#ifdef MUT_OTX_NO_RECHECK
       if :: true ->
#else
       if :: live[t] ->                /* ... _recheck_lease, COMMIT; else ROLLBACK */
#endif
          I2(t, mytok); dom[t] = D_INPROGRESS; check()
       :: else -> goto lost
       fi
     }
  :: atomic { lk[t] == 0 -> finish(t, SUCCESS); goto lost }     /* the handler returned */
  :: atomic { lk[t] == 0 -> finish(t, FAILED); goto lost }      /* it raised / timed out / shutdown */
  :: atomic {                                                   /* warm shutdown, retry-safe */
       lk[t] == 0 && RETRY_SAFE(t) && mytok < MAXATT ->
       /* TaskStore.release: an owning transaction that hands the task back */
       if :: OWNED(t) -> skip :: else -> goto lost fi;
       if :: skip :: live[t] = 0 fi;
       if :: live[t] -> I2(t, mytok); end_attempt(t); st[t] = PENDING; due[t] = 0; relay(); check() :: else -> skip fi;
       goto lost
     }
  :: goto lost                                                  /* the process dies */
  od;

cancelled:
  atomic { lk[t] == 0 -> finish(t, CANCELLED) };

lost:      /* the attempt is over for this worker (ended, refused, or the process died) */
  atomic { t = 0; mytok = 0; steps = 0; ok = 0; goto idle }
}

init {
  byte i;
  atomic {
    i = 0;
    do
    :: i < W -> run Worker(i); i++
    :: else -> break
    od
  }
}

/* Liveness (weak fairness, pan -a -f): every committed task reaches a terminal state (I3), and
 * cancel intent on a running task ends it: cancelled, or by the owner's own terminal write. */
ltl live { [] (submitted[0] -> <> (st[0] >= SUCCESS)) && [] (submitted[1] -> <> (st[1] >= SUCCESS))
  && [] (creq[0] -> <> (st[0] == CANCELLED || (ownerend[0] && st[0] >= SUCCESS)))
  && [] (creq[1] -> <> (st[1] == CANCELLED || (ownerend[1] && st[1] >= SUCCESS))) }
