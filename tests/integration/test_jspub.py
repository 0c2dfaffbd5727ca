"""The lean JetStream publisher against real nats-servers: acks, dedupe, refusals, a
server that stops answering or goes away and comes back, credentials, and what it hands
to nats-py (claim-checked payloads, TLS servers)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from infra import localservers
from schemas import subjects as S
from services.common.bus import CLAIM_HEADER, CLAIM_THRESHOLD, Bus
from services.common.jspub import DuplicateMessage, JetStreamPublisher, PublishError
from tests.helpers.node import proc_state
from tests.helpers.streams import stored_messages


def publisher(url: str, bus: Bus | None = None, **kw) -> JetStreamPublisher:
    async def no_fallback(*_a, **_k):
        raise AssertionError("went to the fallback")

    kw.setdefault("fallback_above", 768 * 1024)
    return JetStreamPublisher(url, name="test", fallback=bus.publish if bus else no_fallback, **kw)


async def test_publishes_are_stored_once_per_msg_id_and_acked_with_their_sequence(bus, nats_url):
    pub = publisher(nats_url)
    subject = S.completions("jspub-a")
    try:
        seqs = await asyncio.gather(
            *(pub.publish(subject, b"record %d" % i, msg_id=f"jspub-a:{i}") for i in range(50))
        )
        again = await pub.publish(subject, b"record 7, retried", msg_id="jspub-a:7")
        plain = await pub.publish(subject, b"no id")
    finally:
        await pub.aclose()
    assert len(set(seqs)) == 50 and again == seqs[7] and plain > max(seqs)
    msgs = await stored_messages(bus, subject)
    assert [m.data for m in msgs] == [b"record %d" % i for i in range(50)] + [b"no id"]
    assert msgs[3].headers["Nats-Msg-Id"] == "jspub-a:3"


async def test_a_subject_no_stream_takes_is_an_error(nats_url):
    pub = publisher(nats_url)
    try:
        with pytest.raises(PublishError, match="no JetStream stream"):
            await pub.publish("not.a.polar.subject", b"x")
    finally:
        await pub.aclose()


async def test_a_payload_over_the_threshold_goes_through_the_claim_check(bus, nats_url):
    pub = publisher(nats_url, bus, fallback_above=CLAIM_THRESHOLD)
    big_payload = os.urandom(CLAIM_THRESHOLD // 2).hex().encode()  # 1 byte over
    subject = S.completions("jspub-big")
    try:
        await pub.publish(subject, b"small", msg_id="big:0")
        await pub.publish(subject, big_payload + b"!", msg_id="big:1")
    finally:
        await pub.aclose()
    small, big = await stored_messages(bus, subject)
    assert small.data == b"small" and CLAIM_HEADER not in (small.headers or {})
    assert big.headers[CLAIM_HEADER] and await bus.payload(big) == big_payload + b"!"


async def test_a_stalled_server_times_out_and_a_restarted_one_is_reconnected(tmp_path):
    port = localservers.free_port()
    url = f"nats://127.0.0.1:{port}"
    proc = localservers.start_nats(port, tmp_path / "n")
    await (await Bus.open(url, "test-jspub")).close()  # declares the streams
    pub = publisher(url)  # 10 s for the acks a live server owes (a loaded one is slow)
    subject = S.completions("jspub-restart")
    try:
        assert await pub.publish(subject, b"1", msg_id="r:1") == 1
        pub.ack_timeout = 0.5  # what the stalled and the stopped server get
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            await stopped(proc.pid)  # kill() returns before every thread has stopped
            with pytest.raises(PublishError, match="no JetStream ack in time"):
                await pub.publish(subject, b"2", msg_id="r:2")
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        localservers.stop_process(proc.pid)
        with pytest.raises(PublishError):  # down: refused, not hanging
            await pub.publish(subject, b"3", msg_id="r:3")
        pub.ack_timeout = 10.0  # a restarted server recovering its store may be slow to ack
        proc = localservers.start_nats(port, tmp_path / "n")  # same store: the stream is back
        seq = await pub.publish(subject, b"4", msg_id="r:4")
        assert seq >= 2  # the stalled "2" may have been stored before the server stopped
    finally:
        await pub.aclose()
        localservers.stop_process(proc.pid)


async def test_user_and_password_from_the_url(nats_with):
    port = nats_with("--user", "polar", "--pass", "s3cret")
    good = f"nats://polar:s3cret@127.0.0.1:{port}"
    bus = await Bus.open(good, "test-auth")
    pub, bad = publisher(good), publisher(f"nats://polar:wrong@127.0.0.1:{port}")
    try:
        assert await pub.publish(S.completions("jspub-auth"), b"x", msg_id="a:1") >= 1
        with pytest.raises(PublishError, match="(?i)authorization"):
            await bad.publish(S.completions("jspub-auth"), b"x", msg_id="a:2")
    finally:
        await pub.aclose()
        await bad.aclose()
        await bus.close()


async def stopped(pid: int, within: float = 5.0) -> None:
    """Wait until every thread of ``pid`` is stopped (state T in /proc): under load a
    thread still running when SIGSTOP was sent could answer one more publish."""
    deadline = time.monotonic() + within
    while not all(s in "Tt" for s in thread_states(pid)):
        assert time.monotonic() < deadline, f"pid {pid} not stopped: {thread_states(pid)}"
        await asyncio.sleep(0.005)


def thread_states(pid: int) -> list[str]:
    states = [proc_state(f"/proc/{pid}/task/{t}/stat") for t in os.listdir(f"/proc/{pid}/task")]
    return [s for s in states if s] or ["?"]


@pytest.fixture
def nats_with(tmp_path):
    """Start a nats-server (JetStream) with extra options; returns its port."""
    started = []

    def start(*extra: str) -> int:
        port = localservers.free_port()
        argv = [localservers.nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js"]
        argv += ["-sd", str(tmp_path / f"js{port}"), *extra]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(proc)
        localservers.wait_listening("127.0.0.1", port, proc)
        return port

    yield start
    for proc in started:
        proc.terminate()
        proc.wait()


def _self_signed(dest: Path) -> tuple[Path, Path]:
    cert, key = dest / "cert.pem", dest / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_a_tls_server_is_left_to_nats_py(tmp_path, nats_with):
    cert, key = _self_signed(tmp_path)
    port = nats_with("--tls", "--tlscert", str(cert), "--tlskey", str(key))
    calls = []

    async def fallback(subject, payload, *, msg_id=None):
        calls.append((subject, payload, msg_id))
        return type("Ack", (), {"seq": 42})()

    pub = JetStreamPublisher(
        f"nats://127.0.0.1:{port}", name="t", fallback=fallback, fallback_above=1 << 20
    )
    assert await pub.publish("polar.completions.x", b"p", msg_id="x:0") == 42
    assert await pub.publish("polar.completions.x", b"q", msg_id="x:1") == 42
    assert calls == [("polar.completions.x", b"p", "x:0"), ("polar.completions.x", b"q", "x:1")]
    assert "TLS" in pub.unsupported


async def test_new_only_refuses_a_message_whose_id_is_stored(bus, nats_url):
    pub = publisher(nats_url)
    subject = S.completions("jspub-new")
    try:
        first = await pub.publish(subject, b"call 0", msg_id="jspub-new:0", new_only=True)
        assert await pub.publish(subject, b"call 0, again", msg_id="jspub-new:0") == first
        with pytest.raises(DuplicateMessage, match="already stored"):
            await pub.publish(subject, b"another call 0", msg_id="jspub-new:0", new_only=True)
    finally:
        await pub.aclose()
    assert [m.data for m in await stored_messages(bus, subject)] == [b"call 0"]
