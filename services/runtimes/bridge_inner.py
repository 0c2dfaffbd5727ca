"""Inside a network-less sandbox: forward 127.0.0.1:PORT to a Unix socket, run a command.

    python -I -S bridge_inner.py PORT SOCKET_PATH COMMAND [ARG...]

It listens before it starts the command (so the command never races the bridge), exits
with the command's exit status, and takes the sandbox down with it. Standard library
only: it runs under the host interpreter without site-packages.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

_CHUNK = 65536


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(_CHUNK):
            dst.sendall(chunk)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)  # pass the half-close on
    except OSError:
        pass


def _serve_one(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _accept_forever(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve_one, args=(client, path), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    port, path, command = int(argv[1]), argv[2], argv[3:]
    listener = socket.create_server(("127.0.0.1", port))
    threading.Thread(target=_accept_forever, args=(listener, path), daemon=True).start()
    try:
        code = subprocess.call(command)
    except OSError as exc:
        print(f"bridge: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
