"""The proxy's HTTP server under a flood of held, unauthenticated connections (issue 33,
item 3): descriptors before, during and after, and what normal calls get meanwhile
(plain script, not in `just test`).

    python tests/bench/bench_proxy_flood.py [--attackers 5000] [--nofile 4096]
                                            [--hold 15] [--src CHECKOUT]

The proxy runs as `polar serve proxy` runs it (``serve_native``, uvloop, default
``HttpLimits``) with a scripted model (tests/integration/proxy_sdk_app.py), its
open-files limit set to ``--nofile`` (soft and hard: the proxy raises soft to hard at
start, so this is the limit it runs at). ``--attackers`` connections are opened, a fifth
each of: a head never finished, ``Expect: 100-continue`` without a valid token, a body
announced and never sent, a body trickled a byte every 2 s, a chunk of 2^64 - 1 bytes.
They are held ``--hold`` seconds (below the 30 s body and head timeouts: the caps, not
the timeouts, are what is measured), while a normal client calls the model and
``/healthz`` over and over; then the attackers close and the proxy's descriptors are
counted until they settle. Two scenarios: the attackers on one address (127.0.0.2, the
normal client on 127.0.0.1: the per-client cap), and spread over 50 addresses (the
total cap). ``--src``: run the proxy of another checkout (say, one from before the caps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from infra import localservers  # noqa: E402
from tests.integration.proxy_sdk_app import TOKEN  # noqa: E402

CHAT = f"/s/{TOKEN}/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
CALL = (
    f"POST {CHAT} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    f"content-length: {len(BODY)}\r\n\r\n"
).encode() + BODY
HEALTH = b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n"
BAD = "/s/not-a-token/v1/chat/completions"
SHAPES = {
    "head never ends": f"POST {BAD} HTTP/1.1\r\nhost: t\r\n".encode(),
    "expect, no token": (
        f"POST {BAD} HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 10\r\n\r\n"
    ).encode(),
    "body never sent": f"POST {BAD} HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n".encode(),
    "trickled body": f"POST {BAD} HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n".encode(),
    "huge chunk": (
        f"POST {BAD} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nffffffffffffffff\r\nx"
    ).encode(),
}


def start_proxy(src: Path, port: int, nofile: int, log: Path) -> subprocess.Popen:
    code = (
        "from proxy.io.native import serve_native; "
        f"serve_native('tests.integration.proxy_sdk_app:make_app', '127.0.0.1', {port})"
    )

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    env = {**os.environ, "PYTHONPATH": str(src), "POLAR_TEST_MARKERS": str(log.parent)}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=src,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=limit,
            start_new_session=True,
        )


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def request(port: int, data: bytes, timeout: float = 10.0) -> tuple[str, float]:
    """(status or what went wrong, seconds) for one request on a fresh connection."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, TimeoutError) as exc:
        return f"connect: {type(exc).__name__}", time.perf_counter() - t0
    try:
        writer.write(data)
        line = await asyncio.wait_for(reader.readline(), timeout)
        status = line.split()[1].decode() if line else "closed"
    except (OSError, TimeoutError) as exc:
        status = type(exc).__name__
    finally:
        writer.close()
    return status, time.perf_counter() - t0


async def wait_up(port: int, proc: subprocess.Popen) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit("the proxy exited")
        if (await request(port, HEALTH, 1.0))[0] == "200":
            return
        await asyncio.sleep(0.1)
    raise SystemExit("the proxy did not come up")


class Attack:
    def __init__(self, port: int, sources: list[str]) -> None:
        self.port, self.sources = port, sources
        self.writers: list[asyncio.StreamWriter] = []
        self.readers: list[asyncio.StreamReader] = []
        self.failed: Counter[str] = Counter()
        self._trickles: list[asyncio.Task] = []

    async def open(self, n: int) -> None:
        shapes = list(SHAPES.items())
        for i in range(n):
            name, data = shapes[i % len(shapes)]
            source = self.sources[i % len(self.sources)]
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", self.port, local_addr=(source, 0)
                )
            except OSError as exc:
                self.failed[f"connect {exc.errno}"] += 1
                continue
            writer.write(data)
            self.readers.append(reader)
            self.writers.append(writer)
            if name == "trickled body":
                self._trickles.append(asyncio.ensure_future(self._trickle(reader, writer)))

    async def _trickle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await asyncio.sleep(2)
            if reader.at_eof() or reader._buffer or writer.is_closing():  # noqa: SLF001
                return  # answered or closed: a write now would only log an error
            writer.write(b"x")

    def answered(self) -> Counter[str]:
        """What the attackers' connections got back so far (a 503, closed, nothing)."""
        got: Counter[str] = Counter()
        for reader in self.readers:
            buffered = bytes(reader._buffer)  # noqa: SLF001 (a bench: peek, don't consume)
            if buffered.startswith(b"HTTP/1.1 100"):
                buffered = buffered.partition(b"\r\n\r\n")[2]
            if buffered.startswith(b"HTTP/1.1 "):
                got[buffered[9:12].decode()] += 1
            elif reader.at_eof():
                got["closed"] += 1
            else:
                got["held"] += 1
        return got

    def close(self) -> None:
        for task in self._trickles:
            task.cancel()
        for writer in self.writers:
            writer.close()


async def normal_calls(port: int, until: float) -> tuple[Counter[str], list[float], Counter[str]]:
    statuses: Counter[str] = Counter()
    health: Counter[str] = Counter()
    latencies: list[float] = []
    while time.monotonic() < until:
        status, took = await request(port, CALL)
        statuses[status] += 1
        if status == "200":
            latencies.append(took)
        health[(await request(port, HEALTH))[0]] += 1
        await asyncio.sleep(0.05)
    return statuses, latencies, health


async def settle(pid: int, target: int, wait: float = 60.0) -> tuple[int, float]:
    t0 = time.monotonic()
    while (n := fds(pid)) > target and time.monotonic() - t0 < wait:
        await asyncio.sleep(0.1)
    return n, time.monotonic() - t0


async def scenario(args, name: str, sources: list[str]) -> None:
    port = localservers.free_port()
    log = Path(args.workdir) / f"proxy-{name.replace(' ', '-')}.log"
    proc = start_proxy(Path(args.src), port, args.nofile, log)
    try:
        await wait_up(port, proc)
        for _ in range(20):
            await request(port, CALL)
        await asyncio.sleep(0.5)
        before = fds(proc.pid)
        quiet, quiet_lat, _ = await normal_calls(port, time.monotonic() + 2)
        attack = Attack(port, sources)
        t0 = time.monotonic()
        await attack.open(args.attackers)
        opened = time.monotonic() - t0
        during_fds = fds(proc.pid)
        statuses, latencies, health = await normal_calls(port, time.monotonic() + args.hold)
        peak = max(during_fds, fds(proc.pid))
        answered = attack.answered()
        attack.close()
        after, took = await settle(proc.pid, before)
        post_status = (await request(port, CALL))[0]
        print(f"\n== {name}: {args.attackers} attackers from {len(sources)} address(es)")
        print(f"  proxy open-files limit {args.nofile}; {log_line(log)}")
        print(f"  attackers: opened in {opened:.1f} s; connect failures {dict(attack.failed)}")
        print(f"  attackers' connections at the end of the hold: {dict(answered)}")
        print(f"  proxy fds: before {before}, during {during_fds} (peak seen {peak}), "
              f"after {after} ({took:.1f} s after the attackers closed)")  # fmt: skip
        print(f"  normal calls, quiet: {dict(quiet)}, median {ms(quiet_lat)}")
        print(f"  normal calls during: {dict(statuses)}, median {ms(latencies)}, "
              f"p99 {ms(latencies, 0.99)}; /healthz during: {dict(health)}")  # fmt: skip
        print(f"  a call after: {post_status}")
        warnings = [line for line in log.read_text().splitlines() if "past the" in line]
        print(f"  log lines about the caps: {len(warnings)}; first: {warnings[:1]}")
    finally:
        localservers.stop_process(proc.pid)
        proc.wait(10)


def log_line(log: Path) -> str:
    for line in log.read_text().splitlines():
        if "listening" in line:
            return line.split("listening", 1)[1].strip()
    return "(no start line)"


def ms(values: list[float], q: float = 0.5) -> str:
    if not values:
        return "-"
    if q == 0.5:
        return f"{statistics.median(values) * 1000:.1f} ms"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.1f} ms"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attackers", type=int, default=5000)
    ap.add_argument("--nofile", type=int, default=4096)
    ap.add_argument("--hold", type=float, default=15.0)
    ap.add_argument("--src", default=str(REPO))
    ap.add_argument("--workdir", default="/tmp")
    ap.add_argument("--scenarios", default="one,many")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attackers' own sockets
    if "one" in args.scenarios:
        await scenario(args, "one address", ["127.0.0.2"])
    if "many" in args.scenarios:
        await scenario(args, "50 addresses", [f"127.0.1.{i}" for i in range(1, 51)])


if __name__ == "__main__":
    asyncio.run(main())
