"""``wait_listening`` waits for the started process's own listener, not anyone's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from infra import localservers


def test_another_process_listening_on_the_port_is_not_the_server():
    # the race this guards: the port went to someone else's server between free_port and
    # the bind; it answers, but ours never will
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
        try:
            assert localservers.reachable("127.0.0.1", port, 0.5)
            assert localservers.listens(os.getpid(), port)
            assert not localservers.listens(ours.pid, port)
            with pytest.raises(localservers.ServerStartError, match="did not listen"):
                localservers.wait_listening("127.0.0.1", port, ours, timeout=0.5)
        finally:
            ours.kill()
            ours.wait()


def test_a_server_that_exits_on_its_bind_is_reported_as_exited():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        code = f"import socket; socket.socket().bind(('127.0.0.1', {port}))"
        ours = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
        with pytest.raises(localservers.ServerStartError, match="exited with 1"):
            localservers.wait_listening("127.0.0.1", port, ours, timeout=10)


def test_the_started_server_is_found_listening(tmp_path):
    port = localservers.free_port()
    proc = localservers.start_nats(port, tmp_path / "nats")
    try:
        assert localservers.listens(proc.pid, port)
    finally:
        localservers.stop_process(proc.pid)
