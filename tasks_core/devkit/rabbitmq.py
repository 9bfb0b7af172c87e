"""A RabbitMQ virtual host of one run's own (a test session, a fault campaign, a benchmark), made
and removed with ``rabbitmqctl`` on this machine's node, so runs never share queues.

Its broker outage is one the run can undo without touching anyone else: the user's permissions on
the vhost are cleared and the vhost's connections closed (every reconnect is then refused with
``NOT_ALLOWED``, as a broker that is down would refuse it), and later set again. The node itself is
never restarted: other people's vhosts live on it.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from urllib.parse import quote, unquote, urlsplit, urlunsplit

# The RabbitMQ that every machine here and CI runs.
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
CTL_TIMEOUT = 60.0


class RabbitMQError(RuntimeError):
    """rabbitmqctl is missing or failed; the message says which command and why."""


def is_amqp(url: str) -> bool:
    return url.split("://", 1)[0] in AMQP_SCHEMES


def masked(url: str) -> str:
    """A broker URL without its password (for replay lines and result files)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _ctl(*args: str) -> str:
    exe = shutil.which("rabbitmqctl")
    if exe is None:
        raise RabbitMQError("rabbitmqctl not found: RabbitMQ is not installed on this machine")
    try:
        done = subprocess.run([exe, "--quiet", *args], capture_output=True, text=True, timeout=CTL_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise RabbitMQError(f"rabbitmqctl {args[0]} did not answer within {CTL_TIMEOUT:g} s") from exc
    if done.returncode != 0:
        raise RabbitMQError(f"rabbitmqctl {' '.join(args)}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


class PrivateVhost:
    """``create()`` a fresh vhost on the node behind ``base_url`` (which must be this machine's:
    rabbitmqctl reaches the local node only) and grant the URL's user everything on it; ``delete()``
    drops it with its queues. ``url`` is then ``base_url`` pointed at the new vhost."""

    def __init__(self, base_url: str = DEFAULT_URL, prefix: str = "dtask") -> None:
        if not is_amqp(base_url):
            raise RabbitMQError(f"not a RabbitMQ URL (amqp://user:password@host:5672/): {base_url!r}")
        parts = urlsplit(base_url)
        if parts.hostname not in LOOPBACK:
            raise RabbitMQError(f"RabbitMQ host is {parts.hostname!r}: a private vhost is made with "
                                "rabbitmqctl on this machine's node, so the URL must name 127.0.0.1")
        self.user = unquote(parts.username or "guest")
        self.name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.url = urlunsplit(parts._replace(path="/" + quote(self.name, safe="")))
        self.created = False

    def create(self) -> str:
        _ctl("add_vhost", self.name)
        self.created = True
        self.grant()
        return self.url

    def delete(self) -> None:
        if self.created:
            _ctl("delete_vhost", self.name)
            self.created = False

    def grant(self) -> None:
        _ctl("set_permissions", "-p", self.name, self.user, ".*", ".*", ".*")

    def revoke(self) -> None:
        """The outage: no permission on the vhost, and every open connection to it closed."""
        _ctl("clear_permissions", "-p", self.name, self.user)
        self.close_connections("dtask: broker outage")

    def close_connections(self, reason: str) -> str:
        """Close every client connection to this vhost (CONNECTION_FORCED), nobody else's."""
        return _ctl("close_all_connections", "--vhost", self.name, reason).strip()
