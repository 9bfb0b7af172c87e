"""The embedded servers behind `dtask dev` and the test fallback really start, serve and stop."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shutil
import signal
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import asyncpg
import psutil
import pytest
import redis

from tasks_core.devkit.embedded import (
    EmbeddedPostgres,
    EmbeddedRedis,
    create_database,
    drop_database,
    free_port,
    reachable,
)


def _dsn(url: str) -> str:
    # asyncpg takes the libpq form of the SQLAlchemy URL.
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def _fetchval(url: str, sql: str) -> object:
    conn = await asyncpg.connect(_dsn(url))
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def _execute(url: str, sql: str) -> None:
    conn = await asyncpg.connect(_dsn(url))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def pg_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("embedded-pg")


@pytest.fixture(scope="module")
def pg(pg_dir: pathlib.Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(pg_dir)
    server.start()
    yield server
    server.destroy()


def test_postgres_serves_tcp_on_loopback(pg: EmbeddedPostgres) -> None:
    url = pg.start()  # idempotent: the running server's URL
    superuser = r"postgresql\+asyncpg://postgres:[A-Za-z0-9_-]{32}@127\.0\.0\.1:\d+/postgres"
    assert re.fullmatch(superuser, url), url
    assert reachable(url)
    assert asyncio.run(_fetchval(url, "SELECT 1")) == 1
    # Listening on loopback only, not on a unix socket.
    assert asyncio.run(_fetchval(url, "SHOW listen_addresses")) == "127.0.0.1"
    assert asyncio.run(_fetchval(url, "SHOW unix_socket_directories")) == ""


def _without_password(url: str) -> str:
    return re.sub(r"//([^:/@]*):[^@]+@", r"//\1@", url).replace("//@", "//")


def _private(path: pathlib.Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) == 0o600


def test_postgres_wants_the_password_kept_in_the_data_dir(
    pg: EmbeddedPostgres, pg_dir: pathlib.Path
) -> None:
    url = pg.start()
    with pytest.raises(asyncpg.InvalidPasswordError):  # no password (it used to trust every connection)
        asyncio.run(_fetchval(_without_password(url), "SELECT 1"))
    with pytest.raises(asyncpg.InvalidPasswordError):
        asyncio.run(_fetchval(re.sub(r"(//[^:/@]+:)", r"\1x", url), "SELECT 1"))  # a wrong one
    kept = pg_dir / "postgres.password"
    assert _private(kept) and kept.read_text().strip() in url
    assert asyncio.run(_fetchval(url, "SHOW password_encryption")) == "scram-sha-256"


def test_the_app_database_belongs_to_a_role_that_is_no_superuser(pg: EmbeddedPostgres) -> None:
    from tasks_core.devkit.embedded import EmbeddedAppDatabase

    url = EmbeddedAppDatabase(pg, "appdb").start()
    assert url.startswith("postgresql+asyncpg://appdb:") and url.endswith("/appdb")
    assert asyncio.run(_fetchval(url, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")) is False
    owner = "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()"
    assert asyncio.run(_fetchval(url, owner)) == "appdb"
    asyncio.run(_execute(url, "CREATE TABLE mine (v int)"))  # migrations run as this role
    for forbidden in ("COPY (SELECT 1) TO PROGRAM 'true'", "SELECT pg_read_file('/etc/passwd')",
                      "ALTER SYSTEM SET work_mem = '1GB'"):  # fmt: skip
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            asyncio.run(_execute(url, forbidden))
    with pytest.raises(asyncpg.InvalidPasswordError):
        asyncio.run(_fetchval(_without_password(url), "SELECT 1"))
    assert EmbeddedAppDatabase(pg, "appdb").start() == url  # the same password on every start


def test_a_cluster_that_trusted_everyone_is_locked_at_the_next_start(tmp_path: pathlib.Path) -> None:
    """As an earlier release left it: trust in pg_hba.conf, no password, the app's database and
    its tables owned by the superuser."""
    from tasks_core.devkit.embedded import EmbeddedAppDatabase

    first = EmbeddedPostgres(tmp_path)
    admin = first.start()
    db = create_database(admin, "legacy")
    asyncio.run(_execute(db, "CREATE TABLE kept (id bigserial PRIMARY KEY, v int)"))
    asyncio.run(_execute(db, "INSERT INTO kept (v) VALUES (7)"))
    first.stop()
    (first.pgdata / "pg_hba.conf").write_text("host all all 127.0.0.1/32 trust\n")
    (tmp_path / "postgres.password").unlink()
    again = EmbeddedPostgres(tmp_path)
    try:
        admin = again.start()
        with pytest.raises(asyncpg.InvalidPasswordError):
            asyncio.run(_fetchval(_without_password(admin), "SELECT 1"))
        url = EmbeddedAppDatabase(again, "legacy").start()
        asyncio.run(_execute(url, "INSERT INTO kept (v) VALUES (8)"))  # its table and sequence
        assert asyncio.run(_fetchval(url, "SELECT sum(v) FROM kept")) == 15
    finally:
        again.destroy()


def test_create_and_drop_database(pg: EmbeddedPostgres) -> None:
    admin = pg.start()
    name = f"dtask-test-{uuid.uuid4().hex[:8]}"  # a hyphen proves the identifier is quoted
    url = create_database(admin, name)
    assert url == admin.rsplit("/", 1)[0] + "/" + name
    assert asyncio.run(_fetchval(url, "SELECT current_database()")) == name

    async def drop_while_connected() -> None:
        # A session left open on the database must not block the drop.
        conn = await asyncpg.connect(_dsn(url))
        try:
            await asyncio.to_thread(drop_database, admin, name)
        finally:
            await conn.close(timeout=2)

    asyncio.run(drop_while_connected())
    exists = asyncio.run(_fetchval(admin, f"SELECT count(*) FROM pg_database WHERE datname = '{name}'"))
    assert exists == 0
    drop_database(admin, name)  # IF EXISTS: dropping twice is fine


async def test_database_helpers_work_inside_a_running_loop(pg: EmbeddedPostgres) -> None:
    admin = pg.start()
    name = f"dtask_loop_{uuid.uuid4().hex[:8]}"
    url = create_database(admin, name)
    assert await _fetchval(url, "SELECT 1") == 1
    drop_database(admin, name)


def test_postgres_data_survives_restart(pg: EmbeddedPostgres, pg_dir: pathlib.Path) -> None:
    url = pg.start()
    asyncio.run(_execute(url, "CREATE TABLE IF NOT EXISTS kept (v int); INSERT INTO kept VALUES (7)"))
    pg.stop()
    pg.stop()  # idempotent
    assert not reachable(url, timeout=0.5)

    again = EmbeddedPostgres(pg_dir)
    try:
        url2 = again.start()
        assert url2 == url  # the previous port is reused while free
        assert asyncio.run(_fetchval(url2, "SELECT sum(v) FROM kept")) == 7
    finally:
        again.stop()
    pg.start()  # leave the module fixture running


def test_redis_serves_and_stops(tmp_path: pathlib.Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    try:
        assert re.fullmatch(r"redis://:[A-Za-z0-9_-]{32}@127\.0\.0\.1:\d+/0", url), url
        assert reachable(url)
        anonymous = redis.Redis.from_url(_without_password(url))
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        kept = tmp_path / "redis" / "redis.password"
        assert _private(kept) and kept.read_text().strip() in url
        # The password is in a config file of ours, not on a command line that `ps` shows.
        assert kept.read_text().strip() not in " ".join(psutil.Process(server.pid).cmdline())
        client = redis.Redis.from_url(url)
        try:
            assert client.ping()
            assert client.set("k", "v")
            assert client.get("k") == b"v"
            assert client.config_get("bind")["bind"] == "127.0.0.1"
            assert client.config_get("save")["save"] == ""
        finally:
            client.close()
    finally:
        server.stop()
    server.stop()  # idempotent
    assert not reachable(url, timeout=0.5)


def test_redis_on_a_requested_port(tmp_path: pathlib.Path) -> None:
    port = free_port()
    with EmbeddedRedis(tmp_path, port=port) as server:
        assert server.url is not None and server.url.endswith(f"@127.0.0.1:{port}/0")
        assert reachable(server.url)
        first = server.url
    assert server.url is None
    with EmbeddedRedis(tmp_path, port=port) as server:
        assert server.url == first  # the password is kept with the data directory


def test_reachable_rejects_what_it_cannot_check() -> None:
    assert not reachable(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    assert not reachable(f"postgresql+asyncpg://u@127.0.0.1:{free_port()}/db", timeout=0.5)
    with pytest.raises(ValueError):
        reachable("http://127.0.0.1:80/")


def _modes(paths: list[pathlib.Path], within: pathlib.Path) -> dict[pathlib.Path, int]:
    # Only directories this test owns: pytest runs elsewhere on the machine re-chmod the shared
    # /tmp/pytest-of-<user> themselves.
    return {p: stat.S_IMODE(p.stat().st_mode) for p in paths if p.is_relative_to(within)}


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs PostgreSQL as another account")
def test_as_root_no_directory_outside_the_data_dir_is_widened(tmp_path: pathlib.Path) -> None:
    # A home directory others may not enter, as /root and most homes are.
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    home.chmod(0o700)
    data = home / "project" / ".dtask" / "postgres"
    data.mkdir(parents=True)
    before = _modes(list(data.parents), tmp_path)
    server = EmbeddedPostgres(data)
    try:
        url = server.start()
        assert asyncio.run(_fetchval(url, "SELECT 1")) == 1
        assert _modes(list(data.parents), tmp_path) == before
        # The cluster lives where the service account can reach it; the data dir records where.
        cluster = (data / "pgdata").resolve()
        assert not cluster.is_relative_to(home)
        assert (cluster / "PG_VERSION").exists()
    finally:
        server.destroy()
    assert not cluster.exists() and not (data / "pgdata").is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs PostgreSQL as another account")
def test_as_root_a_restart_reuses_the_cluster_and_a_deleted_data_dir_starts_afresh(
    tmp_path: pathlib.Path,
) -> None:
    data = tmp_path / "pg"
    first = EmbeddedPostgres(data)
    url = first.start()
    asyncio.run(_execute(url, "CREATE TABLE kept (v int)"))
    first.stop()
    cluster = (data / "pgdata").resolve()
    again = EmbeddedPostgres(data)
    try:
        url = again.start()
        assert (data / "pgdata").resolve() == cluster
        assert asyncio.run(_fetchval(url, "SELECT count(*) FROM kept")) == 0
    finally:
        again.stop()
    # The user deletes the data directory: its cluster goes with it at the next start of any server.
    shutil.rmtree(data)
    other = EmbeddedPostgres(tmp_path / "other")
    try:
        other.start()
        assert not cluster.exists()
    finally:
        other.destroy()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs PostgreSQL as another account")
def test_as_root_binaries_out_of_reach_are_copied_not_exposed(tmp_path: pathlib.Path) -> None:
    from tasks_core.devkit.embedded import _reachable_bin_dir, _service_account

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    home.chmod(0o700)
    bin_dir = home / "venv" / "pginstall" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "postgres").write_text("#!/bin/sh\necho reachable\n")
    (bin_dir / "postgres").chmod(0o755)
    account = _service_account()
    assert account is not None
    before = _modes([home, *home.parents], tmp_path)
    copied = _reachable_bin_dir(account, bin_dir)
    try:
        assert _modes([home, *home.parents], tmp_path) == before
        ran = subprocess.run(
            [str(copied / "postgres")],
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            check=False,
        )
        assert ran.stdout == "reachable\n", ran.stderr
        assert _reachable_bin_dir(account, bin_dir) == copied  # copied once, then reused
    finally:
        shutil.rmtree(copied.parent)


# --------------------------------------------------------------------------------------------- Milvus, S3


def _eventually(what: str, check: Callable[[], object], timeout: float = 60.0) -> None:
    """``check`` succeeds before the deadline (a client may need a moment to reconnect)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
            problem: object = "falsy"
        except Exception as exc:
            problem = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still failing after {timeout:g} s: {problem!r}")
        time.sleep(0.5)


def test_a_killed_milvus_and_s3_come_back_on_their_ports_for_the_clients_they_had(
    tmp_path: pathlib.Path,
) -> None:
    """`dtask dev`'s servers, supervised as it supervises them: after a SIGKILL each is back on its
    port, and clients made before the crash (every api and worker process holds some) work again."""
    from minio import Minio
    from pymilvus import MilvusClient

    from tasks_core.devkit.dev import BACKING, DevState
    from tasks_core.devkit.embedded_stores import s3_settings
    from tasks_core.devkit.supervisor import RestartPolicy, ServerChild, Supervisor

    said: list[str] = []
    sup = Supervisor(RestartPolicy(first_delay=0.2), say=said.append, poll_seconds=0.1)
    state = DevState.load(tmp_path)
    stores = [b for b in BACKING if b.name in ("milvus", "s3")]
    children = [ServerChild(b.name, b.embedded(tmp_path, state), b.answers) for b in stores]
    runner = threading.Thread(target=sup.run)
    try:
        for child in children:
            sup.start(child)
        sup.wait_ready(children, 120)
        milvus_url, s3_url = (str(c.url) for c in children)
        vectors = MilvusClient(uri=milvus_url)
        vectors.create_collection("kept", dimension=4)
        s3 = s3_settings(s3_url)
        endpoint, access, secret = (s3[f"DTASK_MINIO_{k}"] for k in ("ENDPOINT", "ACCESS_KEY", "SECRET_KEY"))
        objects = Minio(endpoint, access, secret, secure=False)
        objects.make_bucket("kept")
        runner.start()
        # This test's own servers: the session's shared ones are children of this process too.
        servers = {" ".join(p.cmdline()): p for p in psutil.Process().children()}
        for needle in ("milvus_lite", "weed"):
            (server,) = [p for cmd, p in servers.items() if needle in cmd and str(tmp_path) in cmd]
            server.kill()
        _eventually("both back", lambda: sum(" is back " in line for line in said) == 2, timeout=120)
        assert [c.url for c in children] == [milvus_url, s3_url], said
        _eventually("the Milvus client", lambda: vectors.has_collection("kept"))
        _eventually("the S3 client", lambda: objects.bucket_exists("kept"))
        vectors.close()
    finally:
        sup.stop_signal = signal.SIGTERM
        if runner.is_alive():
            runner.join(timeout=10)
        sup.stop_all()


def test_dev_says_in_one_line_when_a_kept_port_is_taken(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from tasks_core.devkit.dev import BACKING, DevState, Source, Stack, _start_servers
    from tasks_core.devkit.supervisor import Supervisor

    state = DevState.load(tmp_path)
    # Only Redis is embedded here (the others "come from the environment" and are not started).
    sources = {b.var: Source(None if b.name == "redis" else "configured", "the environment") for b in BACKING}
    sources["DTASK_REDIS_URL"] = Source(None, "embedded")
    sup = Supervisor()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        state.ports["redis"] = port  # what the last run on this data directory used
        try:
            _start_servers(sup, Stack(tmp_path, state, sources))
        finally:
            sup.stop_all()
    said = [line for line in capsys.readouterr().err.splitlines() if str(port) in line]
    assert len(said) == 1 and "redis" in said[0] and "taken" in said[0], said
    assert state.ports["redis"] != port
