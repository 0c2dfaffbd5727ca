"""Session affinity across 3 real embedded-server workers; kill -9 one, its sessions move.

Each worker is a separate ``python -m services.engine`` process (its own process
group) on a free port; the pool routes with the SGLang client, and which worker served a
call is read from ``Generation.worker`` (its base URL, i.e. its port).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pytest

from infra.localservers import free_port
from proxy.backends.base import ChatRequest, SamplingParams, TokenRequest
from proxy.backends.factory import make_pool
from proxy.backends.pool import BackendPool
from schemas.completion import UpstreamMode

SESSIONS = [f"session-{i:02d}" for i in range(30)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
START_TIMEOUT_S = 90.0
# a call answers in well under a second here; a stuck one fails the test at once with the
# workers' logs (a CI run once sat out pytest's 300 s on one, with nothing to read)
CALL_TIMEOUT = {"http": {"timeout_s": 60.0}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.engine.modelinit import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("embedded") / "model")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as resp:
            return resp.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def workers(model_dir, tmp_path_factory):
    procs: list[subprocess.Popen] = []
    urls: list[str] = []
    logs = tmp_path_factory.mktemp("worker-logs")
    try:
        for i in range(3):
            port = free_port()
            cmd = [sys.executable, "-m", "services.engine", "--model-dir", str(model_dir)]
            cmd += ["--port", str(port), "--weight-version", "1"]
            with open(logs / f"worker-{i}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
                    )
                )
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_healthy(u) for u in urls):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail(f"embedded workers did not start: {[p.poll() for p in procs]}")
            time.sleep(0.3)
        yield procs, urls, logs
    finally:
        for proc in procs:
            _stop(proc)


@contextlib.contextmanager
def logs_on_failure(logs):
    """A failing test prints what the workers said (into its captured output)."""
    try:
        yield
    except BaseException:
        for path in sorted(logs.iterdir()):
            print(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        raise


async def route_all(pool: BackendPool, prompt: list[int]) -> dict[str, str]:
    async def one(session: str) -> tuple[str, str]:
        gen = await pool.generate(
            TokenRequest(session_id=session, input_ids=prompt, sampling=GREEDY)
        )
        assert len(gen.output_ids) == len(gen.output_logprobs) > 0
        return session, gen.worker

    return dict(await asyncio.gather(*(one(s) for s in SESSIONS)))


async def test_weight_update_control_reaches_every_worker(workers, model_dir):
    _, urls, logs = workers
    pool = make_pool("embedded", urls, modes=(UpstreamMode.TOKEN,), settings=CALL_TIMEOUT)
    with logs_on_failure(logs):
        await _control_reaches_every_worker(pool, urls, model_dir)


async def _control_reaches_every_worker(pool, urls, model_dir):
    try:
        assert (await pool.probe()).workers == 3
        await pool.pause()
        assert await pool.update_weights_from_disk(str(model_dir), "2") == "2"
        await pool.flush_cache()
        await pool.resume()
        assert await pool.weight_version() == "2"
        served = set()
        # 30 sessions: 9 missed one of the 3 workers now and then (3 * (2/3)**9 ~ 8% of
        # random ports); 30 miss one with odds of ~2e-5
        for session in SESSIONS:
            gen = await pool.generate(
                TokenRequest(session_id=session, input_ids=[1, 2, 3], sampling=GREEDY)
            )
            assert gen.weight_version == "2"
            served.add(gen.worker)
        assert served == set(urls)
    finally:
        await pool.aclose()


async def test_affinity_survives_a_killed_worker(workers):
    procs, urls, logs = workers
    pool = make_pool("embedded", urls, settings=CALL_TIMEOUT)
    with logs_on_failure(logs):
        await _affinity_survives_a_killed_worker(pool, procs, urls)


async def _affinity_survives_a_killed_worker(pool, procs, urls):
    try:
        caps = await pool.probe()
        assert caps.workers == 3 and caps.chat_token_ids and caps.token_mode
        assert caps.weight_version in ("1", "2")  # "2" once the control test ran

        # one real chat call and one token call through the SGLang client
        chat = await pool.chat(
            ChatRequest(
                session_id=SESSIONS[0],
                messages=[{"role": "user", "content": "list the files"}],
                sampling=GREEDY,
            )
        )
        assert chat.prompt_ids and chat.output_ids and chat.weight_version == caps.weight_version
        assert len(chat.output_logprobs) == len(chat.output_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in chat.output_logprobs)
        tokens = await pool.generate(
            TokenRequest(session_id=SESSIONS[0], input_ids=chat.prompt_ids, sampling=GREEDY)
        )
        assert tokens.prompt_ids == chat.prompt_ids and tokens.worker == chat.worker
        assert tokens.output_ids == chat.output_ids  # same prompt ids, greedy: same tokens

        before = await route_all(pool, chat.prompt_ids)
        assert await route_all(pool, chat.prompt_ids) == before  # sticky
        counts = Counter(before.values())
        assert set(counts) == set(urls)

        victim = urls.index(counts.most_common(1)[0][0])
        os.killpg(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait(timeout=10)

        after = await route_all(pool, chat.prompt_ids)
        moved = {s for s in SESSIONS if after[s] != before[s]}
        assert moved and moved == {s for s in SESSIONS if before[s] == urls[victim]}
        assert urls[victim] not in after.values()
        assert all(after[s] == before[s] for s in SESSIONS if s not in moved)
        assert pool.healthy() == [u for u in urls if u != urls[victim]]
        assert pool.failovers >= 1
    finally:
        await pool.aclose()
