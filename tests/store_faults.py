"""A Milvus and an S3 server of their own, for the tests that pause, kill and restart them.

The session's shared stores (the ``knowledge_stores`` fixture) stay untouched: these are started
once per test session too, on ports of their own, and restarted on the same ports after a kill,
as a supervisor would. Their DTASK_* settings are what a test passes to its api and workers.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
from collections.abc import Iterator
from typing import Literal

from tasks_core.devkit.embedded_stores import EmbeddedMilvus, EmbeddedS3

Store = Literal["milvus", "s3"]


class FaultyStores:
    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.milvus = EmbeddedMilvus(root / "milvus")
        self.s3 = EmbeddedS3(root / "s3")
        self.env: dict[str, str] = {}

    def start(self) -> dict[str, str]:
        uri, endpoint = self.milvus.start(), self.s3.start()
        self.env = {"DTASK_MILVUS_URI": uri, **endpoint.env(), "DTASK_MINIO_BUCKET": "dtask-faults"}
        return self.env

    def settings(self) -> dict[str, object]:
        """The same, as Settings fields (for an in-process api)."""
        e = self.env
        return {
            "milvus_uri": e["DTASK_MILVUS_URI"],
            "minio_endpoint": e["DTASK_MINIO_ENDPOINT"],
            "minio_access_key": e["DTASK_MINIO_ACCESS_KEY"],
            "minio_secret_key": e["DTASK_MINIO_SECRET_KEY"],
            "minio_bucket": e["DTASK_MINIO_BUCKET"],
        }

    def _server(self, which: Store) -> EmbeddedMilvus | EmbeddedS3:
        return self.milvus if which == "milvus" else self.s3

    def pid(self, which: Store) -> int:
        proc = self._server(which)._proc  # the server's own process (the test pauses exactly it)
        assert proc is not None, f"{which} is not running"
        return proc.pid

    def pause(self, which: Store) -> None:
        os.kill(self.pid(which), signal.SIGSTOP)

    def resume(self, which: Store) -> None:
        os.kill(self.pid(which), signal.SIGCONT)

    @contextlib.contextmanager
    def paused(self, which: Store) -> Iterator[None]:
        self.pause(which)
        try:
            yield
        finally:
            self.resume(which)

    def kill(self, which: Store) -> None:
        """SIGKILL, as a crash would; ``restart`` brings it back on the same port and data."""
        server = self._server(which)
        os.kill(self.pid(which), signal.SIGKILL)
        server.stop()  # reaps the process and forgets the address

    def restart(self, which: Store) -> None:
        if which == "milvus":
            port = int(self.env["DTASK_MILVUS_URI"].rsplit(":", 1)[1])
            self.milvus = EmbeddedMilvus(self.root / "milvus", port)
            assert self.milvus.start() == self.env["DTASK_MILVUS_URI"]
        else:
            port = int(self.env["DTASK_MINIO_ENDPOINT"].rsplit(":", 1)[1])
            self.s3 = EmbeddedS3(self.root / "s3", port)
            assert self.s3.start().endpoint == self.env["DTASK_MINIO_ENDPOINT"]

    def stop(self) -> None:
        for server in (self.milvus, self.s3):
            if server._proc is not None:  # a paused server would ignore the stop's SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server._proc.pid, signal.SIGCONT)
            server.stop()
