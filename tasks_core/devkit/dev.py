"""`dtask dev`: the whole system in one command, supervised.

PostgreSQL and Redis come from DTASK_DATABASE_URL / DTASK_BROKER_URL when those name servers of
your own; otherwise embedded servers run from wheels under the data directory. Then it migrates,
runs worker, beat, the API and Flower, and prints the banner once every child answers its health
check. A crashed child is restarted with backoff; SIGINT, SIGTERM and SIGHUP stop everything.

Ports and the session API key are kept per data directory (``dev.json``) and the CLI environment
(servers, API URL and key) is written to ``<data-dir>/env``, so a shell that sourced it stays right
across restarts. One `dtask dev` runs per data directory (``dev.lock``); every process it starts
carries the directory in DTASK_DEV_DIR, so what a killed one left running (holding the kept ports
and the servers' data) is found and stopped by the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tasks_core.devkit.cluster import answers_ping
from tasks_core.devkit.embedded import write_private
from tasks_core.devkit.processes import tcp_connects
from tasks_core.devkit.supervisor import (
    ChildFailed,
    EmbeddedServer,
    LogFollower,
    ProcessChild,
    RestartPolicy,
    ServerChild,
    StopRequested,
    Supervisor,
)
from tasks_core.settings import Settings

DEV_DATABASE = "dtask"
# Marks every process of a stack with its data directory (inherited by the children's children).
DEV_DIR_VAR = "DTASK_DEV_DIR"
# A leftover worker gets its shutdown grace period; servers flush on SIGTERM.
LEFTOVER_STOP_SECONDS = 30.0
READY_TIMEOUT = 120.0  # first start of a worker on a slow machine; a healthy one takes a few seconds
PROBE_TIMEOUT = 2.0
POLICY = RestartPolicy()


def _say(line: str) -> None:
    print(f"dtask dev: {line}", file=sys.stderr, flush=True)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tasks_core.ops.cli", *args]


# --------------------------------------------------------------------------------------------- state


@dataclass
class DevState:
    """What stays the same across runs on one data directory (``dev.json``, readable by you only)."""

    path: Path
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    ports: dict[str, int] = field(default_factory=dict)
    exports: dict[str, str] = field(default_factory=dict)  # the CLI environment last written

    @classmethod
    def load(cls, root: Path) -> DevState:
        path = root / "dev.json"
        with contextlib.suppress(OSError, ValueError, TypeError):
            data = json.loads(path.read_text())
            return cls(path, data["api_key"], dict(data.get("ports", {})), dict(data.get("exports", {})))
        return cls(path)

    def save(self) -> None:
        body = {"api_key": self.api_key, "ports": self.ports, "exports": self.exports}
        write_private(self.path, json.dumps(body, indent=1) + "\n")


def _write_env_file(path: Path, exports: dict[str, str], root: Path) -> None:
    lines = [f"# `dtask dev` on {root}: `source` this file to point the CLI at that stack"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in exports.items()]
    write_private(path, "\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------- one stack


def _hold(root: Path) -> Any | None:
    """The data directory's lock, held until this process exits; None while another `dtask dev`
    holds it."""
    root.mkdir(parents=True, exist_ok=True)
    handle = (root / "dev.lock").open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _leftovers(root: Path) -> list[Any]:
    """Processes of an earlier stack on ``root`` that outlived it (its `dtask dev` was killed)."""
    import psutil

    mine = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in mine:
            continue
        with contextlib.suppress(psutil.Error, OSError):  # another user's, or gone meanwhile
            if proc.environ().get(DEV_DIR_VAR) == str(root) or _logs_to(proc.pid, root / "logs"):
                found.append(proc)
    return found


def _logs_to(pid: int, logs: Path) -> bool:
    # Servers that rewrite their process title (Redis, PostgreSQL) overwrite the environment
    # psutil reads; their output still goes to a log of the stack (Linux: /proc).
    with contextlib.suppress(OSError):
        return Path(os.readlink(f"/proc/{pid}/fd/1")).parent == logs
    return False


def _stop_leftovers(root: Path) -> None:
    import psutil

    procs = _leftovers(root)
    if not procs:
        return
    _say(f"stopping {len(procs)} process(es) left by an earlier `dtask dev` on {root}")
    for proc in procs:
        # Only the processes it started (each leads its own session) are asked: they stop their
        # own children in order. SIGINT is every one's clean stop (milvus-lite's only one).
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(proc.pid) == proc.pid:
                proc.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(procs, timeout=LEFTOVER_STOP_SECONDS)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


# --------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """A setting's value and where it came from: "the environment", ".env" or "embedded"."""

    value: str | None
    origin: str


def _source(var: str, value: str | None, state: DevState) -> Source:
    if not value:
        return Source(None, "embedded")
    if state.exports.get(var) == value:
        # The shell sourced this data directory's env file: that names our own embedded server.
        return Source(None, "embedded")
    return Source(value, "the environment" if var in os.environ else ".env")


def _explicit_redis_url(settings: Settings) -> str | None:
    # Settings fills redis_url from the broker when it is unset; only an explicit one counts here.
    from dotenv import dotenv_values

    if "DTASK_REDIS_URL" in os.environ or dotenv_values(".env").get("DTASK_REDIS_URL"):
        return settings.redis_url
    return None


# --------------------------------------------------------------------------------------------- servers


def _postgres_answers(url: str) -> bool:
    return _database_problem(url) is None


def _database_problem(url: str) -> str | None:
    """None when PostgreSQL answers at ``url``, else one line saying why not."""
    from tasks_core.ops.cli_errors import classify

    async def probe() -> None:
        import asyncpg

        dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
        conn = await asyncpg.connect(dsn, timeout=PROBE_TIMEOUT)
        try:
            await conn.fetchval("SELECT 1")
        finally:
            await conn.close()

    try:
        asyncio.run(probe())
    except Exception as exc:
        problem = classify(exc, url)
        return str(problem) if problem else f"{type(exc).__name__}: {exc}"
    return None


def _redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT, socket_connect_timeout=PROBE_TIMEOUT)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _kept_port(state: DevState, name: str) -> int | None:
    """The port ``name`` had on the last run, while it is free (else the server picks one, and
    ``_start_servers`` says so)."""
    from tasks_core.devkit.embedded import port_is_free

    port = state.ports.get(name)
    return port if port and port_is_free(port) else None


def _embedded_postgres(root: Path, state: DevState) -> EmbeddedServer:
    from tasks_core.devkit.embedded import EmbeddedAppDatabase, EmbeddedPostgres

    server = EmbeddedPostgres(
        root / "postgres", _kept_port(state, "postgres"), log_path=root / "logs" / "postgres.log"
    )
    # Every process connects as the database's owner, never as the superuser.
    return EmbeddedAppDatabase(server, DEV_DATABASE)


def _embedded_redis(root: Path, state: DevState) -> EmbeddedServer:
    from tasks_core.devkit.embedded import EmbeddedRedis

    return EmbeddedRedis(root / "redis", _kept_port(state, "redis"), log_path=root / "logs" / "redis.log")


def _embedded_milvus(root: Path, state: DevState) -> EmbeddedServer:
    from tasks_core.devkit.embedded_stores import EmbeddedMilvus

    return EmbeddedMilvus(root / "milvus", _kept_port(state, "milvus"), log_path=root / "logs" / "milvus.log")


def _embedded_s3(root: Path, state: DevState) -> EmbeddedServer:
    from tasks_core.devkit.embedded_stores import EmbeddedS3, EmbeddedS3Server

    server = EmbeddedS3(root / "s3", _kept_port(state, "s3"), log_path=root / "logs" / "s3.log")
    return EmbeddedS3Server(server)


def _s3_settings(url: str) -> dict[str, str]:
    from tasks_core.devkit.embedded_stores import s3_settings

    return s3_settings(url)


def _url_port_open(url: str) -> bool:
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    return tcp_connects(parts.hostname or "127.0.0.1", parts.port or 0, PROBE_TIMEOUT)


@dataclass(frozen=True)
class Backing:
    """A server the stack needs: the one a setting names, or an embedded one under the data dir.
    More embedded servers (Milvus, S3) are one more entry each in BACKING."""

    name: str  # the child's name in logs and messages
    label: str  # the banner's
    var: str  # the setting that names a server of your own
    setting: Callable[[Settings], str | None]
    embedded: Callable[[Path, DevState], EmbeddedServer]
    answers: Callable[[str], bool]
    problem: Callable[[str], str | None]  # why a configured server does not answer
    # Everything to export for an embedded server (default: ``var`` = its URL).
    exports: Callable[[str], dict[str, str]] | None = None


BACKING = (
    Backing(
        "postgres", "PostgreSQL", "DTASK_DATABASE_URL", lambda s: s.database_url,
        _embedded_postgres, _postgres_answers, _database_problem,
    ),
    Backing(
        "redis", "Redis", "DTASK_BROKER_URL", lambda s: s.broker_url,
        _embedded_redis, _redis_answers,
        lambda url: None if _redis_answers(url) else f"cannot reach the broker at {url}",
    ),
    # Knowledge bases. One of your own that does not answer is not fatal: only the /knowledge
    # routes need it, and they answer 503 naming it.
    Backing(
        "milvus", "Milvus", "DTASK_MILVUS_URI", lambda s: s.milvus_uri,
        _embedded_milvus, _url_port_open, lambda url: None,
    ),
    Backing(
        "s3", "S3", "DTASK_MINIO_ENDPOINT", lambda s: s.minio_endpoint,
        _embedded_s3, _url_port_open, lambda url: None, exports=_s3_settings,
    ),
)  # fmt: skip


# --------------------------------------------------------------------------------------------- apps


def _port_open(port: int) -> bool:
    return tcp_connects("127.0.0.1", port, PROBE_TIMEOUT)


def _api_healthy(port: int) -> Callable[[ProcessChild], bool]:
    def probe(_: ProcessChild) -> bool:
        import httpx

        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=PROBE_TIMEOUT).status_code == 200
        except httpx.HTTPError:
            return False

    return probe


def _worker_answers_ping(broker: str, node: str) -> Callable[[ProcessChild], bool]:
    from celery import Celery

    # A private app: only the broker matters for a remote-control ping, and it must not retry
    # for long against a Redis that is down (the supervisor asks again a moment later).
    app = Celery("dtask-dev-probe", broker=broker, set_as_current=False)
    app.conf.update(broker_connection_retry=False, broker_connection_timeout=PROBE_TIMEOUT)

    def probe(_: ProcessChild) -> bool:
        try:
            return answers_ping(app, node, timeout=1.0)
        except Exception:
            return False

    return probe


def _beat_started(child: ProcessChild) -> bool:
    return "beat: Starting..." in child.log_text()


def _apps(
    env: dict[str, str], root: Path, api_port: int, flower_port: int, flower_auth: bool
) -> list[ProcessChild]:
    logs = root / "logs"
    node = f"dtask-dev@{socket.gethostname()}"
    flower = _cli("flower", "--address", "127.0.0.1", "--port", str(flower_port))
    if not flower_auth:
        flower.append("--insecure-local")  # loopback only, dev only
    grace = float(env.get("DTASK_SHUTDOWN_GRACE_SECONDS", "10"))
    return [
        ProcessChild(
            "worker", _cli("worker", "-n", node), env=env, log_path=logs / "worker.log",
            # Running handlers get their grace period, then end through their terminal write.
            ready=_worker_answers_ping(env["DTASK_BROKER_URL"], node), stop_timeout=grace + 20,
        ),
        ProcessChild(
            "beat", _cli("beat", "--schedule", str(root / "celerybeat-schedule")), env=env,
            log_path=logs / "beat.log", ready=_beat_started, stop_timeout=5,
        ),
        ProcessChild(
            "api", _cli("api", "--host", "127.0.0.1", "--port", str(api_port)), env=env,
            log_path=logs / "api.log", ready=_api_healthy(api_port), stop_timeout=10,
        ),
        ProcessChild(
            "flower", flower, env=env, log_path=logs / "flower.log",
            # It holds nothing worth a grace period, and hangs on SIGTERM while Redis is down.
            ready=lambda _: _port_open(flower_port), stop_timeout=5,
        ),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    root: Path
    state: DevState
    sources: dict[str, Source]
    urls: dict[str, str] = field(default_factory=dict)  # exported variable -> URL


def _taken_ports(ports: dict[str, int]) -> str | None:
    from tasks_core.devkit.embedded import port_is_free

    for option, port in ports.items():
        if not port_is_free(port):
            return f"port {port} on 127.0.0.1 is taken: free it or pass {option} PORT"
    return None


def _check_configured(stack: Stack) -> str | None:
    """Why a server that a setting names does not answer, saying where the setting came from."""
    for backing in BACKING:
        source = stack.sources[backing.var]
        if source.value is None:
            continue
        problem = backing.problem(source.value)
        if problem:
            return (
                f"{problem} ({backing.var} came from {source.origin}; unset it to run an embedded "
                f"{backing.label})"
            )
    return None


def _start_servers(sup: Supervisor, stack: Stack) -> None:
    for backing in BACKING:
        source = stack.sources[backing.var]
        if source.value is not None:
            stack.urls[backing.var] = source.value
            continue
        child = ServerChild(backing.name, backing.embedded(stack.root, stack.state), backing.answers)
        sup.start(child)
        sup.wait_ready([child], READY_TIMEOUT)
        assert child.url is not None
        if backing.exports is not None:
            stack.urls.update(backing.exports(child.url))
        else:
            stack.urls[backing.var] = child.url
        port, kept = urlsplit(child.url).port, stack.state.ports.get(backing.name)
        if kept and port != kept:
            _say(
                f"{backing.name}: port {kept}, kept for this data directory, is taken by another "
                f"program; it listens on {port} now (source {stack.root / 'env'} again)"
            )
        if port:
            stack.state.ports[backing.name] = port
    redis_url = stack.sources["DTASK_REDIS_URL"].value
    stack.urls["DTASK_REDIS_URL"] = redis_url or stack.urls["DTASK_BROKER_URL"]


def _migrate(sup: Supervisor, env: dict[str, str], log_path: Path) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        # Its own session: a Ctrl-C meant for `dtask dev` lets the (short) migration finish.
        done = subprocess.run(
            _cli("migrate"),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            check=False,
        )
    sup.check_stop()
    if done.returncode != 0:
        last = (log_path.read_text(errors="replace").strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"`dtask migrate` failed: {last} (log: {log_path})")


def _child_env(stack: Stack, settings: Settings) -> dict[str, str]:
    env = dict(os.environ, **stack.urls, PYTHONUNBUFFERED="1")
    if not settings.api_keys:
        env["DTASK_API_KEYS"] = f"dev:{stack.state.api_key}:admin"
    return env


def _client_exports(settings: Settings, state: DevState, api_port: int) -> dict[str, str]:
    """What the HTTP clients (the domain CLIs) need: the API, and the key unless you set your own."""
    exports = {"DTASK_API_URL": f"http://127.0.0.1:{api_port}"}
    if not settings.api_keys:
        exports["DTASK_API_KEY"] = state.api_key
    return exports


def run_dev(
    settings: Settings,
    *,
    data_dir: str | None = None,
    api_port: int = 8000,
    flower_port: int = 5555,
    verbose: bool = False,
) -> int:
    root = Path(data_dir or settings.dev_dir).resolve()
    taken = _taken_ports({"--api-port": api_port, "--flower-port": flower_port})
    if taken:
        _say(taken)
        return 2
    lock = _hold(root)
    if lock is None:
        _say(f"another `dtask dev` runs on {root}: stop it first, or pass --data-dir")
        return 2
    _stop_leftovers(root)
    os.environ[DEV_DIR_VAR] = str(root)  # every process started from here on inherits it
    state = DevState.load(root)
    sources = {b.var: _source(b.var, b.setting(settings), state) for b in BACKING}
    sources["DTASK_REDIS_URL"] = _source("DTASK_REDIS_URL", _explicit_redis_url(settings), state)
    stack = Stack(root, state, sources)
    problem = _check_configured(stack)
    if problem:
        _say(problem)
        return 2
    sup = Supervisor(POLICY)
    sup.install_signal_handlers()
    follower = _follow_logs(stack) if verbose else None
    try:
        _start_servers(sup, stack)
        previous = dict(state.exports)
        state.exports = dict(stack.urls) | _client_exports(settings, state, api_port)
        state.save()
        _write_env_file(root / "env", state.exports, root)
        env = _child_env(stack, settings)
        sup.check_stop()
        _migrate(sup, env, root / "logs" / "migrate.log")
        apps = _apps(env, root, api_port, flower_port, bool(settings.flower_basic_auth))
        for app in apps:
            sup.start(app)
        sup.wait_ready(apps, READY_TIMEOUT)
        _banner(stack, settings, api_port, flower_port, changed=bool(previous) and previous != state.exports)
        return sup.run()
    except StopRequested:
        return 0
    except ChildFailed as exc:
        _say(f"{exc}; its log ends:\n{_tail(exc.child)}")
        return 1
    except Exception as exc:  # an embedded server that cannot start, a failed migration
        _say(str(exc))
        return 1
    finally:
        if follower is not None:
            follower.done.set()
        sup.stop_all()
        _sweep()


def _follow_logs(stack: Stack) -> LogFollower:
    names = [b.name for b in BACKING if stack.sources[b.var].value is None]
    names += ["migrate", "worker", "beat", "api", "flower"]
    follower = LogFollower({name: stack.root / "logs" / f"{name}.log" for name in names})
    follower.start()
    return follower


def _tail(child: Any, lines: int = 20) -> str:
    text = child.log_text() if isinstance(child, ProcessChild) else ""
    return "\n".join(text.splitlines()[-lines:]) or "(nothing)"


def _sweep() -> None:
    """Last resort: any descendant still alive (say, one started as a signal arrived) is killed."""
    import psutil

    leftovers = psutil.Process().children(recursive=True)
    for proc in leftovers:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    if leftovers:
        psutil.wait_procs(leftovers, timeout=5)
        _say(f"killed {len(leftovers)} leftover process(es)")


# --------------------------------------------------------------------------------------------- banner


def _shown(url: str) -> str:
    """``url`` without its password (the env file has it; a terminal's scrollback need not)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def _origin(stack: Stack, var: str, name: str) -> str:
    source = stack.sources[var]
    if source.value is not None:
        return f"{var} from {source.origin}"
    return f"embedded, logs/{name}.log"


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<11}: {value}" + (f"  ({note})" if note else "")


def _banner(stack: Stack, settings: Settings, api_port: int, flower_port: int, *, changed: bool) -> None:
    root, urls = stack.root, stack.urls
    key = (
        _row("API key", "yours, from DTASK_API_KEYS")
        if settings.api_keys
        else _row("API key", stack.state.api_key, "admin; kept for this data dir; DTASK_API_KEYS sets yours")
    )
    flower = "DTASK_FLOWER_BASIC_AUTH" if settings.flower_basic_auth else "no password: loopback only"
    lines = [
        "durable-tasks dev stack is ready (Ctrl-C stops everything)",
        _row(
            "PostgreSQL", _shown(urls["DTASK_DATABASE_URL"]), _origin(stack, "DTASK_DATABASE_URL", "postgres")
        ),
        _row("Redis", _shown(urls["DTASK_BROKER_URL"]), _origin(stack, "DTASK_BROKER_URL", "redis")),
        _row("Milvus", urls["DTASK_MILVUS_URI"], _origin(stack, "DTASK_MILVUS_URI", "milvus")),
        _row("S3", urls["DTASK_MINIO_ENDPOINT"], _origin(stack, "DTASK_MINIO_ENDPOINT", "s3")),
        _row("worker", "dtask worker (queues durable, duties)"),
        _row("beat", "dtask beat (publisher, reconciler)"),
        _row("API", f"http://127.0.0.1:{api_port}", "OpenAPI at /docs"),
        _row("Flower", f"http://127.0.0.1:{flower_port}", flower),
        key,
        _row("CLI env", f"source {root / 'env'}", "changed since the last run" if changed else ""),
        _row("logs", str(root / "logs"), "--verbose shows them here"),
        _row(
            "supervised",
            f"a crashed child restarts with backoff; {POLICY.max_crashes} crashes within "
            f"{POLICY.window:g} s stop the stack",
        ),
        _row("try", 'dtask submit diagnostics.sleep --payload \'{"seconds": 5, "steps": 5}\' --wait'),
    ]
    print("\n".join(lines), flush=True)
