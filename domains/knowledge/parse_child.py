"""The parse process: extracts and chunks one file at a time for ``parse_process.parse_file``.

Run as ``python -m domains.knowledge.parse_child MEMORY_MB PARENT_PID``. It lowers its priority
and limits its own address space once, and moves its CPU limit on before each file; it dies with
the thread that started it (Linux) and exits when its stdin closes. It never imports asyncio,
which took 85 of the 112 ms this module took to import with the parent's code; a format's
libraries load with its first file (python-docx and lxml 190 ms, docutils 120 ms,
charset-normalizer 45 ms, once per process, against a budget of DTASK_KNOWLEDGE_PARSE_SECONDS
per file). Protocol on stdin/stdout: a JSON header line and the file's bytes in; a reply of an
8-byte length and JSON out, ``{"chunks": [...]}`` or
``{"error": message, "kind": "limit" | "parse" | "memory"}``.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import resource
import signal
import sys
from typing import Any, BinaryIO

from domains.knowledge.chunking import iter_chunks
from domains.knowledge.parsing import LimitExceeded, ParseError, extract_text

# Parsing an uploaded file is the one CPU work of a worker whose cost the file decides: it runs at
# a lower priority, so a hostile file yields the cores to everything else the worker does (other
# tenants' tasks, heartbeats, the duties). Beside three hostile uploads of one tenant, another
# tenant's 20 files took 1.74 times as long as alone at the same priority, 1.19 times at this one
# (`dtask bench knowledge-ingest --beside-hostile`, 2 cores).
NICENESS = 10
# After a file this large its object graph (pypdf's has cycles) is collected before waiting for
# the next, so an idle process holds little; a collection costs 5-15 ms, too much for every file.
COLLECT_AFTER_BYTES = 1024 * 1024


def parse(data: bytes, file_type: str, max_chars: int, max_chunks: int) -> list[str]:
    """The chunk texts of a file, within the character and chunk limits."""
    chunks: list[str] = []
    for chunk in iter_chunks(extract_text(data, file_type, max_chars)):
        if len(chunks) == max_chunks:
            raise LimitExceeded(
                f"the file gives more than {max_chunks:,} chunks (DTASK_KNOWLEDGE_MAX_CHUNKS)"
            )
        chunks.append(chunk)
    return chunks


def _die_with_parent(parent: int) -> None:
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _limit_cpu(seconds: float) -> None:
    """Let this process use ``seconds`` more CPU (and a second of slack); past it the kernel
    ends it with SIGXCPU. A check beside the parent's deadline that holds if the parent stalls."""
    used = sum(os.times()[:2])
    soft = math.ceil(used + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _answer(request: dict[str, Any], data: bytes) -> dict[str, Any]:
    try:
        return {"chunks": parse(data, request["file_type"], request["max_chars"], request["max_chunks"])}
    except LimitExceeded as exc:
        return {"error": str(exc), "kind": "limit"}
    except ParseError as exc:
        return {"error": str(exc), "kind": "parse"}
    except MemoryError:
        return {"error": "out of memory", "kind": "memory"}


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise SystemExit(0)  # the parent went away mid-request
    return data


def serve(memory_mb: int, parent: int) -> None:
    """One file at a time from stdin, until stdin closes."""
    _die_with_parent(parent)
    os.nice(NICENESS)
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which stops us
    logging.basicConfig(level=logging.WARNING, format="parse process %(process)d: %(name)s: %(message)s")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt a reply
    while header := stdin.readline():
        request = json.loads(header)
        data = _read(stdin, request["size"])
        _limit_cpu(request["seconds"])
        reply = json.dumps(_answer(request, data), ensure_ascii=False).encode()
        del data
        stdout.write(len(reply).to_bytes(8, "big") + reply)
        stdout.flush()
        del reply
        if request["size"] >= COLLECT_AFTER_BYTES:
            gc.collect()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
