"""Bubblewrap command lines (pure): one sandbox per command, sharing the session directory.

Each command gets its own PID namespace (`--unshare-pid`) and dies with its parent
(`--die-with-parent`): when the command's top process dies, the namespace and everything
in it go with it, whatever its children did with sessions and process groups. The host is
read-only, the session directory writable, /tmp private. All capabilities are dropped so
that root inside cannot remount the host writable.

The host's private places are masked (``PRIVATE_DIRS`` become empty tmpfs, the password
and sudo files ``/dev/null``), and so is the directory holding every session of this
node (``hide``): a harness sees its own session directory, never another's, the
operator's home, this package's checkout (wherever it is) or the stack's state and
credentials. What a harness needs from under a masked place is bound back read-only:
the Python that runs the proxy bridge, this package's bridge script, and ``expose`` (the
harness install cache).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from services.runtimes.bridge import INNER_SCRIPT

BRIDGE_SOCKET_INSIDE = "/run/polar/proxy.sock"
PRIVATE_DIRS = (
    "/root",
    "/home",
    "/work",
    "/srv",
    "/mnt",
    "/media",
    "/opt/polar",
    "/var/lib",
    "/var/log",
    "/var/spool",
    "/var/mail",
    "/var/backups",
    "/etc/ssl/private",
    "/etc/ssh",
    "/run/secrets",
)
SECRET_FILES = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/security/opasswd",
)


def checkout_root() -> str | None:
    """The source checkout this package runs from, wherever it lives (CI's is not under
    /work): its files, credentials-bearing state and .env are the operator's, not the
    harness's. None for an installed package (no pyproject.toml beside ``services``)."""
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / "pyproject.toml").is_file() else None


def _under(path: str, roots: tuple[str, ...] | list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def bwrap_argv(
    *,
    session_dir: str,
    cwd: str,
    isolate_network: bool,
    bridge_socket: str | None = None,
    hide: tuple[str, ...] = (),
    expose: tuple[str, ...] = (),
) -> list[str]:
    argv = [
        "bwrap",
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--cap-drop",
        "ALL",
    ]
    if isolate_network:
        argv.append("--unshare-net")
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    if isolate_network:
        # Host Unix sockets (service sockets under /run) would bypass the network cut;
        # with the host network shared they reach nothing new, and /run may hold DNS config.
        argv += ["--tmpfs", "/run"]
    private = [d for d in (*PRIVATE_DIRS, checkout_root(), *hide) if d and os.path.isdir(d)]
    for d in sorted(set(private), key=len):
        if not _under(d, [p for p in private if p != d]):  # the outermost is enough
            argv += ["--tmpfs", d]
    argv += [a for f in SECRET_FILES if os.path.exists(f) for a in ("--ro-bind", "/dev/null", f)]
    masked = ["/tmp", *private, *(["/run"] if isolate_network else [])]
    for path in needed_inside(expose):  # e.g. the interpreter under /root, a venv under /work
        if _under(path, masked):
            argv += ["--ro-bind", path, path]
    argv += ["--bind", session_dir, session_dir]
    if bridge_socket is not None:
        argv += ["--bind", bridge_socket, BRIDGE_SOCKET_INSIDE]
    argv += ["--chdir", cwd, "--"]
    return argv


def needed_inside(expose: tuple[str, ...] = ()) -> list[str]:
    """``host_paths_needed_inside`` and ``expose``, each also by its real path (links in a
    cache point at where it really is)."""
    host = host_paths_needed_inside()
    extra = {
        q
        for p in expose
        if p and os.path.isdir(p)
        for q in (os.path.abspath(p), os.path.realpath(p))
    }
    return host + sorted(extra - set(host))


def host_paths_needed_inside() -> list[str]:
    """What the sandbox must see of this host even where it is masked (a private /tmp):
    the Python that runs the proxy bridge and this package's own files."""
    paths = {
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        str(INNER_SCRIPT.resolve().parent),
    }
    return sorted(p for p in paths if p and os.path.isdir(p))


def bridge_prefix(port: int) -> list[str]:
    """Runs the command under the inner bridge: 127.0.0.1:port -> the bound socket."""
    return [sys.executable, "-I", "-S", str(INNER_SCRIPT), str(port), BRIDGE_SOCKET_INSIDE]
