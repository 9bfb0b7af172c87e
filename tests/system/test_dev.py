"""`dtask dev`: the whole stack on embedded PostgreSQL, Redis, Milvus and S3, supervised, stopped by
any of SIGINT, SIGTERM and SIGHUP with nothing left behind, the same environment on every start,
and no server open without its password."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest
import redis

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
BANNER_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
BANNER_FIELDS = {
    "postgres": r"PostgreSQL : (\S+)",
    "redis": r"Redis      : (\S+)",
    "milvus": r"Milvus     : (\S+)",
    "s3": r"S3         : (\S+)",
    "api": r"API        : (\S+)",
    "flower": r"Flower     : (\S+)",
    "key": r"API key    : (\S+)",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port(url: str) -> int:
    return int(re.search(r":(\d+)(/|$)", url).group(1))  # type: ignore[union-attr]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Dev:
    """One `dtask dev` process, its output in a file, its descendants tracked for the checks."""

    def __init__(self, tmp: Path, data_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = tmp / f"dev-{time.monotonic_ns()}.log"
        self.data_dir = data_dir
        self.api_port, self.flower_port = _free_port(), _free_port()
        base = {k: v for k, v in os.environ.items() if not k.startswith("DTASK_")}
        base["PYTHONPATH"] = str(ROOT)
        argv = [sys.executable, "-m", "tasks_core.ops.cli", "dev", "--data-dir", str(data_dir)]
        argv += ["--api-port", str(self.api_port), "--flower-port", str(self.flower_port), *args]
        with self.log.open("wb") as out:
            # Its own session, as a shell gives a foreground job: a signal to the test runner never
            # reaches it, and killpg() reaches exactly what a terminal's Ctrl-C would.
            self.proc = subprocess.Popen(
                argv, env={**base, **(env or {})}, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self.seen: list[psutil.Process] = []

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = BANNER_TIMEOUT, start: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.compile(pattern, re.M).search(self.output(), start)
            if found:
                return found
            assert self.proc.poll() is None, f"dtask dev exited with {self.proc.returncode}:\n{self.output()}"
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not printed within {timeout:g} s:\n{self.output()[-5000:]}")

    def banner(self) -> dict[str, str]:
        end = self.wait_for(r"^  try ").end()
        text = self.output()[:end]
        return {name: re.search(pattern, text).group(1) for name, pattern in BANNER_FIELDS.items()}  # type: ignore[union-attr]

    def remember_processes(self) -> list[psutil.Process]:
        """Every process of the stack now: dev's descendants (pool children included)."""
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        self.seen += [k for k in kids if k not in self.seen]
        return kids

    def child(self, needle: str) -> psutil.Process:
        for proc in psutil.Process(self.proc.pid).children():
            with contextlib.suppress(psutil.Error):
                if needle in " ".join(proc.cmdline()):
                    return proc
        raise AssertionError(f"no child of dtask dev runs {needle!r}")

    def survivors(self) -> list[str]:
        alive = []
        for proc in self.seen:
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{proc.pid} {' '.join(proc.cmdline())}")
        return alive

    def stop(self, sig: signal.Signals) -> float:
        """Send ``sig`` as a terminal (SIGINT: its foreground group) or `kill` would; seconds to exit."""
        self.remember_processes()
        started = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=STOP_TIMEOUT)
        return time.monotonic() - started

    def kill(self) -> None:
        """Teardown: whatever is left, by the pids this test saw."""
        if self.proc.poll() is None:
            self.remember_processes()
            self.proc.kill()
            self.proc.wait()
        for proc in self.seen:
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One data directory for the module: later starts reuse its cluster, as a developer's do."""
    path = tmp_path_factory.mktemp("dev") / ".dtask"
    yield path
    pgdata = path / "postgres" / "pgdata"
    if pgdata.is_symlink():  # as root the cluster lives outside the data directory
        shutil.rmtree(pgdata.resolve().parent, ignore_errors=True)


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[list[Dev]]:
    started: list[Dev] = []
    yield started
    for d in started:
        d.kill()


FIRST_BANNER: dict[str, str] = {}


def _exported(data_dir: Path) -> dict[str, str]:
    """The CLI environment `dtask dev` wrote (the banner shows no passwords)."""
    return dict(re.findall(r"^export (\w+)=(\S+)$", (data_dir / "env").read_text(), re.M))


def _without_password(url: str) -> str:
    return re.sub(r"//([^:/@]*):[^@]+@", r"//\1@", url).replace("//@", "//")


async def _refused(dsn: str, sql: str = "SELECT 1") -> BaseException:
    try:
        conn = await asyncpg.connect(dsn.replace("postgresql+asyncpg://", "postgresql://", 1), timeout=10)
    except Exception as exc:
        return exc
    try:
        await conn.execute(sql)
    except Exception as exc:
        return exc
    finally:
        await conn.close()
    raise AssertionError(f"{sql!r} ran")


def _check_credentials(data_dir: Path, banner: dict[str, str]) -> None:
    """Every server wants its password, and the app's database role is no superuser."""
    env = _exported(data_dir)
    db, broker = env["DTASK_DATABASE_URL"], env["DTASK_BROKER_URL"]
    assert ":***@" in banner["postgres"] and ":***@" in banner["redis"]  # not on the terminal
    assert isinstance(asyncio.run(_refused(db, "COPY (SELECT 1) TO PROGRAM 'true'")),
                      asyncpg.InsufficientPrivilegeError)  # fmt: skip
    assert isinstance(asyncio.run(_refused(_without_password(db))), asyncpg.InvalidPasswordError)
    anonymous = redis.Redis.from_url(_without_password(broker))
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    assert redis.Redis.from_url(broker).ping()


def _knowledge_round_trip(banner: dict[str, str], word: str, timeout: float = 90.0) -> None:
    """A base (Milvus), an upload (S3), its indexing by the worker (both) and a search (Milvus)."""
    api, headers = banner["api"], {"Authorization": f"Bearer {banner['key']}"}
    r = httpx.post(f"{api}/knowledge/bases", json={"name": word}, headers=headers, timeout=30)
    assert r.status_code == 201, r.text
    base = r.json()["id"]
    upload = [("files", (f"{word}.txt", f"lantern {word} harbor".encode(), "text/plain"))]
    r = httpx.post(f"{api}/knowledge/bases/{base}/files", files=upload, headers=headers, timeout=30)
    assert r.status_code == 202, r.text
    file_id = r.json()["files"][0]["id"]
    deadline, status = time.monotonic() + timeout, None
    while time.monotonic() < deadline and status not in ("indexed", "error_parsing", "error_indexing"):
        status = httpx.get(f"{api}/knowledge/files/{file_id}", headers=headers, timeout=10).json()["status"]
        time.sleep(0.3)
    assert status == "indexed", status
    r = httpx.post(f"{api}/knowledge/bases/{base}/search", json={"query": word, "top_k": 1}, headers=headers,
                   timeout=30)  # fmt: skip
    assert r.status_code == 200 and r.json()["hits"][0]["file_id"] == file_id, r.text


def _submit_and_wait(banner: dict[str, str], n: int = 1, timeout: float = 60.0) -> None:
    headers = {"Authorization": f"Bearer {banner['key']}"}
    ids = []
    for _ in range(n):
        r = httpx.post(
            f"{banner['api']}/tasks", headers=headers, timeout=10,
            json={"task_type": "diagnostics.sleep", "payload": {"seconds": 0.2, "steps": 2}},
        )  # fmt: skip
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    deadline = time.monotonic() + timeout
    for task_id in ids:
        status = None
        while time.monotonic() < deadline and status not in ("success", "failed", "cancelled"):
            got = httpx.get(f"{banner['api']}/tasks/{task_id}", headers=headers, timeout=10)
            status = got.json()["status"]
            time.sleep(0.2)
        assert status == "success", f"task {task_id} ended {status}"


# SIGHUP here; the tests below stop dev with SIGTERM and SIGINT and check the same: nothing left.
@pytest.mark.parametrize("sig", [signal.SIGHUP], ids=lambda s: s.name)
def test_dev_runs_the_stack_and_any_stop_signal_leaves_nothing_behind(
    dev: list[Dev], tmp_path: Path, data_dir: Path, sig: signal.Signals
) -> None:
    env: dict[str, str] = {}
    if (data_dir / "env").exists():
        # A shell that sourced the env file of an earlier run starts dev again: still embedded.
        env = _exported(data_dir)
        assert set(env) >= {"DTASK_DATABASE_URL", "DTASK_BROKER_URL"}
    d = Dev(tmp_path, data_dir, env=env)
    dev.append(d)
    banner = d.banner()
    # Printed once every child is ready: no retry needed.
    assert httpx.get(f"{banner['api']}/healthz", timeout=5).status_code == 200
    assert _listening(_port(banner["flower"]))
    _check_credentials(data_dir, banner)
    # Same ports and key on every start on this data directory.
    FIRST_BANNER.setdefault("banner", banner)  # type: ignore[arg-type]
    first = FIRST_BANNER["banner"]
    for field in ("postgres", "redis", "milvus", "s3", "key"):
        assert banner[field] == first[field], (field, banner, first)  # type: ignore[index]
    _submit_and_wait(banner)
    # Child logs are in the data directory, not on the terminal.
    logs = {p.name for p in (data_dir / "logs").iterdir()}
    assert {"postgres.log", "redis.log", "worker.log", "beat.log", "api.log", "flower.log"} <= logs
    assert "celery@" not in d.output() and "Uvicorn running" not in d.output()

    ports = [_port(banner[name]) for name in ("postgres", "redis", "api", "flower")]
    assert len(d.remember_processes()) >= 6
    seconds = d.stop(sig)
    print(f"{sig.name}: dtask dev exited {seconds:.2f} s after the signal")
    assert d.proc.returncode == 0, d.output()[-3000:]
    assert d.survivors() == [], d.output()[-3000:]
    assert [p for p in ports if _listening(p)] == []


def test_dev_restarts_killed_servers_and_worker_on_their_ports_and_everything_still_works(
    dev: list[Dev], tmp_path: Path, data_dir: Path
) -> None:
    d = Dev(tmp_path, data_dir)
    dev.append(d)
    banner = d.banner()
    _knowledge_round_trip(banner, "before")  # the api and the worker now hold Milvus and S3 clients
    d.remember_processes()
    victims = (
        ("redis-server", "redis"), ("tasks_core.ops.cli worker", "worker"), ("postgres -D", "postgres"),
        ("milvus_lite server", "milvus"), ("weed mini", "s3"),
    )  # fmt: skip
    for needle, name in victims:
        mark = len(d.output())
        victim = d.child(needle)
        killed = time.monotonic()
        victim.kill()
        d.wait_for(rf"^dtask dev: {name} killed by SIGKILL; restarting", timeout=30, start=mark)
        d.wait_for(rf"^dtask dev: {name} is back", timeout=90, start=mark)
        print(f"{name}: back {time.monotonic() - killed:.2f} s after SIGKILL")
        d.remember_processes()
    assert redis.Redis.from_url(_exported(data_dir)["DTASK_BROKER_URL"]).ping()  # on the same port
    _submit_and_wait(banner, n=3, timeout=90)
    _knowledge_round_trip(banner, "after")  # the same clients, the same ports
    ports = [_port(banner[name]) for name in ("postgres", "redis", "api", "flower")]
    d.stop(signal.SIGTERM)
    assert d.proc.returncode == 0
    assert d.survivors() == []
    assert [p for p in ports if _listening(p)] == []


def test_dev_killed_outright_leaves_nothing_that_moves_its_ports(
    dev: list[Dev], tmp_path: Path, data_dir: Path
) -> None:
    """SIGKILL gives `dtask dev` no chance to stop its children: the next start on the data
    directory stops what the killed one left, then every server is back on its kept port; and
    the CLI environment it writes is all the domain CLIs need."""
    d = Dev(tmp_path, data_dir)
    dev.append(d)
    first = d.banner()
    left = d.remember_processes()
    d.proc.kill()
    d.proc.wait()
    assert all(p.is_running() for p in left)  # orphans, holding every port
    # Started from a shell that sourced the env file of the killed run: still embedded.
    again = Dev(tmp_path, data_dir, env=_exported(data_dir))
    dev.append(again)
    banner = again.banner()
    for field in ("postgres", "redis", "milvus", "s3", "key"):
        assert banner[field] == first[field], (field, banner, first)
    assert "left by an earlier `dtask dev`" in again.output(), again.output()
    assert [p.pid for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    env = _exported(data_dir)
    assert env["DTASK_API_URL"] == banner["api"] and env["DTASK_API_KEY"] == banner["key"]
    out = subprocess.run(
        [sys.executable, "-m", "domains.knowledge.cli", "bases"],
        env=_env(**env), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    ports = [_port(banner[name]) for name in ("postgres", "redis", "api", "flower")]
    again.stop(signal.SIGINT)
    assert again.proc.returncode == 0 and again.survivors() == []
    assert [p for p in ports if _listening(p)] == []


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTASK_")}
    return env | {"PYTHONPATH": str(ROOT), **extra}


def test_dev_fails_fast_naming_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = tmp_path / ".dtask"
        out = subprocess.run(
            [sys.executable, "-m", "tasks_core.ops.cli", "dev",
             "--data-dir", str(data), "--api-port", str(port)],
            env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"port {port}" in out.stderr and "--api-port" in out.stderr, out.stderr
    assert not (data / "postgres").exists()  # nothing was started


def test_dev_refuses_a_data_directory_another_dev_runs_on(tmp_path: Path) -> None:
    import fcntl

    data = tmp_path / ".dtask"
    data.mkdir()
    with (data / "dev.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `dtask dev` holds it
        out = subprocess.run(
            [sys.executable, "-m", "tasks_core.ops.cli", "dev", "--data-dir", str(data),
             "--api-port", str(_free_port()), "--flower-port", str(_free_port())],
            env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "another `dtask dev` runs on" in out.stderr, out.stderr
    assert not (data / "postgres").exists()  # nothing was started


def test_dev_names_the_environment_when_its_database_is_unreachable(tmp_path: Path) -> None:
    url = f"postgresql+asyncpg://postgres@127.0.0.1:{_free_port()}/dtask"
    out = subprocess.run(
        [sys.executable, "-m", "tasks_core.ops.cli", "dev", "--data-dir", str(tmp_path / ".dtask")],
        env=_env(DTASK_DATABASE_URL=url), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "DTASK_DATABASE_URL" in out.stderr and "environment" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
