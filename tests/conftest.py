"""Shared fixtures: real nats-server (JetStream) and Valkey on free ports, per test run.

Tests never mock NATS or Redis. Each test run starts its own servers so parallel runs
and the machine's own services are never disturbed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from infra import localservers, setup

# What `just setup` found (DOCKER_HOST of podman's Docker API): the recipe cannot export
# into this process, so it leaves it in .state/test.env. The caller's own settings win.
for _key, _value in setup.read_env().items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session", autouse=True)
def _own_ports() -> None:
    """This test worker's own ports (``localservers.free_port``), below the kernel's
    ephemeral range (32768+): no other worker's pick, no server binding port 0 and no
    outgoing connection can take a port between its choice and the server's bind. (A
    fixture: pytest-xdist names the worker only once its session starts.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw<i>, in a worker
    index = int(worker[2:]) if worker else 0
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1) if worker else 1
    width = (32767 - 20000 + 1) // count
    low = 20000 + index * width
    os.environ.setdefault(localservers.PORT_RANGE_ENV, f"{low}-{low + width - 1}")


@pytest.fixture(scope="session")
def state_dir():
    path = Path(tempfile.mkdtemp(prefix="polar-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_url(state_dir):
    port = localservers.free_port()
    proc = localservers.start_nats(port, state_dir / "nats")
    yield f"nats://127.0.0.1:{port}"
    localservers.stop_process(proc.pid)


@pytest.fixture(scope="session")
def redis_url(state_dir):
    port = localservers.free_port()
    proc = localservers.start_valkey(port, state_dir / "valkey")
    yield f"redis://127.0.0.1:{port}/0"
    localservers.stop_process(proc.pid)


@pytest.fixture
async def bus(nats_url):
    from services.common.bus import Bus

    b = await Bus.open(nats_url, "test")
    yield b
    await b.close()


@pytest.fixture
async def redis_client(redis_url):
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url)
    yield r
    await r.aclose()


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch):
    # Test traffic stays on loopback: make sure no HTTP proxy setting redirects it.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    yield


def pytest_configure(config):
    os.environ.setdefault("POLAR_TEST", "1")


# The longest modules (minutes each), run first: `just test` spreads whole files over two
# workers (pytest-xdist), and one started last would leave the other worker idle at the end.
LONGEST_FIRST = (
    "tests/integration/test_harness_presets.py",
    "tests/chaos/test_kill9.py",
    "tests/cluster/test_multihost.py",
    "tests/integration/test_vllm_real.py",
    "tests/integration/test_proxy_vllm.py",
    "tests/integration/test_harness_vllm.py",
    "tests/integration/test_vllm_real_vocab.py",
    "tests/integration/test_model_families.py",
    "tests/integration/test_trainer_adapters.py",
    "tests/integration/test_trainer.py",  # kill -9 mid-run and resume, served runs (~2.5 min)
    "tests/chaos/test_nats_outage.py",
    "tests/integration/test_examples.py",  # every example at a smoke size, one after another
    "tests/integration/test_dashboard_browser.py",
    "tests/integration/test_replay.py",  # two stacks, a run, replays, re-grades (~1.5 min)
    "tests/integration/test_docs_code.py",  # every tutorial's and how-to's code (~75 s)
    "tests/integration/test_verl_agent_loop.py",  # verl's venv imports verl (~25 s)
    "tests/unit/proxy/test_tito_families.py",
)
# Files that share one worker: they use the session's one vLLM (a start is ~1 minute).
SHARED_WORKER = {
    "tests/integration/test_vllm_real.py": "vllm",
    "tests/integration/test_proxy_vllm.py": "vllm",
    "tests/integration/test_harness_vllm.py": "vllm",
    # a vLLM of its own (a real vocabulary), started after the session's one has stopped
    "tests/integration/test_vllm_real_vocab.py": "vllm",
    # the real CLIs' stacks, one after the other: two at once overload two cores and the
    # CLIs time out
    "tests/integration/test_harness_presets.py": "harness",
    "tests/integration/test_harness_families.py": "harness",
}


def pytest_collection_modifyitems(config, items):
    # A test that needs a part outside the venv (tests/helpers/requires.py) is skipped with
    # the reason, reported at the test's own line, when the part is missing.
    from tests.helpers.requires import missing_reason

    for item in items:
        if reason := missing_reason(item):
            item.add_marker(pytest.mark.skip(reason=reason))
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    users = [i.nodeid for i in items if "vllm_engine" in getattr(i, "fixturenames", ())]
    _vllm["last_user"] = users[-1] if users else None


# The session's vLLM (``vllm_engine``) and the last test that uses it, in run order: idle,
# its worker keeps ~15% of a core busy, so it is stopped after that test rather than at
# the session's end (its files share one worker and run first: minutes before the end).
_vllm: dict = {"last_user": None, "started": None}


@pytest.hookimpl(trylast=True)  # after the test's own teardown (and its module's)
def pytest_runtest_teardown(item, nextitem):
    if item.nodeid == _vllm["last_user"] and _vllm["started"] is not None:
        _vllm["started"].stop()


def pytest_xdist_make_scheduler(config, log):
    """Whole files per worker (module fixtures start once), files in SHARED_WORKER together."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_WORKER.get(path, path)

    return FileScheduling(config, log)


@pytest.fixture
def fresh_servers(tmp_path):
    """A NATS + Valkey pair of this test's own (for tests that consume shared queues)."""
    nport, rport = localservers.free_port(), localservers.free_port()
    nats = localservers.start_nats(nport, tmp_path / "nats")
    valkey = localservers.start_valkey(rport, tmp_path / "valkey")
    yield f"nats://127.0.0.1:{nport}", f"redis://127.0.0.1:{rport}/0"
    localservers.stop_process(nats.pid)
    localservers.stop_process(valkey.pid)


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    """A real vLLM on CPU serving a copy of the tiny model, with ``--enable-scale-out``
    and the model's whole 32k context (tests/helpers/vllm_server.py); one per session,
    stopped after the last test that uses it."""
    from tests.helpers.vllm_server import running_vllm, start_vllm

    if given := running_vllm():  # a developer's server, left running
        yield given
        return
    srv = start_vllm(tmp_path_factory.mktemp("vllm"), scale_out=True)
    _vllm["started"] = srv  # stopped after its last user (pytest_runtest_teardown)
    try:
        yield srv
    finally:
        srv.stop()
