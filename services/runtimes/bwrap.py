"""Bubblewrap command lines (pure): one sandbox per command, sharing the session directory.

Each command gets its own PID namespace (`--unshare-pid`) and dies with its parent
(`--die-with-parent`): when the command's top process dies, the namespace and everything
in it go with it, whatever its children did with sessions and process groups. The host is
read-only, the session directory writable, /tmp private. All capabilities are dropped so
that root inside cannot remount the host writable.
"""

from __future__ import annotations

import os
import sys

from services.runtimes.bridge import INNER_SCRIPT

BRIDGE_SOCKET_INSIDE = "/run/polar/proxy.sock"


def bwrap_argv(
    *,
    session_dir: str,
    cwd: str,
    isolate_network: bool,
    bridge_socket: str | None = None,
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
    masked = ("/tmp", "/run") if isolate_network else ("/tmp",)
    for path in host_paths_needed_inside():  # e.g. a checkout and its venv under /tmp (CI)
        if any(path == m or path.startswith(m + "/") for m in masked):
            argv += ["--ro-bind", path, path]
    argv += ["--bind", session_dir, session_dir]
    if bridge_socket is not None:
        argv += ["--bind", bridge_socket, BRIDGE_SOCKET_INSIDE]
    argv += ["--chdir", cwd, "--"]
    return argv


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
