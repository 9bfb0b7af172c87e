"""The embedded servers behind `dtask dev` and the test fallback really start, serve and stop."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator

import asyncpg
import pytest
import redis

from tasks_core.embedded import (
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
    assert url.startswith("postgresql+asyncpg://postgres@127.0.0.1:")
    assert url.endswith("/postgres")
    assert reachable(url)
    assert asyncio.run(_fetchval(url, "SELECT 1")) == 1
    # Listening on loopback only, not on a unix socket.
    assert asyncio.run(_fetchval(url, "SHOW listen_addresses")) == "127.0.0.1"
    assert asyncio.run(_fetchval(url, "SHOW unix_socket_directories")) == ""


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
        assert url.startswith("redis://127.0.0.1:") and url.endswith("/0")
        assert reachable(url)
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
        assert server.url == f"redis://127.0.0.1:{port}/0"
        assert reachable(server.url)
    assert server.url is None


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
    from tasks_core.embedded import _reachable_bin_dir, _service_account

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
