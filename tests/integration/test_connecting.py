"""Connecting to a `polar up` stack (issue 38): the credentials survive a restart and are
rotated only when asked; every client reads the one environment file `polar up` writes
(or the topology); the `nats` CLI gets a context; refused credentials stop a client at
once with what to do; a bus submission's task shows in `polar status`.

The real `polar` CLI in subprocesses, real nats-server and Valkey on free ports."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import nats
import pytest

from infra import credentials, localservers
from infra.localservers import free_port
from schemas import TaskAccepted, decode
from schemas import subjects as S
from services.cli.connect import open_bus, open_registry
from services.cli.context import Stack, Unreachable
from services.client import TrajectoryClient
from services.client.connection import VARIABLES, from_environment, read_env_file
from services.common.bus import Bus, CredentialsRefused
from tests.helpers.polar_cli import run_polar
from tests.integration.test_devstack import only_scheduler

pytestmark = pytest.mark.timeout(180)
FAST = 20.0  # a refused client stops at once; this only bounds a hang (the old behaviour)


class Polar:
    def __init__(self, root: Path) -> None:
        self.root, self.state = root, root / "state"
        self.topology = root / "topology.yaml"
        self.config_home = root / "xdg"  # the `nats` CLI's contexts go here, not to ~
        self.ports = {name: free_port() for name in ("nats", "redis", "scheduler")}
        self.topology.write_text(
            f"""
nats_url: nats://127.0.0.1:{self.ports["nats"]}
redis_url: redis://127.0.0.1:{self.ports["redis"]}/0
state_dir: {self.state}
{only_scheduler(self.ports["scheduler"])}"""
        )

    def __call__(self, *args: str, timeout: float = 90) -> str:
        r = self.run(*args, timeout=timeout)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def run(self, *args: str, timeout: float = 90):
        env = {"XDG_CONFIG_HOME": str(self.config_home), "POLAR_NATS_CONTEXT": "polar"}
        return run_polar(*args, "-t", str(self.topology), timeout=timeout, env=env)

    @property
    def env_file(self) -> Path:
        return self.state / "polar.env"

    def client_urls(self) -> tuple[str, str]:
        """The operator's NATS and Redis URLs, from the stack's credentials as they are."""
        creds = credentials.load(self.state)
        nats_url = creds.nats_url(f"nats://127.0.0.1:{self.ports['nats']}")
        return nats_url, creds.redis_url(f"redis://127.0.0.1:{self.ports['redis']}/0")


@pytest.fixture(scope="module")
def polar(tmp_path_factory):
    cli = Polar(tmp_path_factory.mktemp("connecting"))
    cli("up")
    yield cli
    cli.run("down")


async def signs_in(nats_url: str, redis_url: str) -> None:
    """A client of the stack as a user's program is one: the bus, the registry, the
    trajectory client (each fails the test if refused or unreachable)."""
    bus = await asyncio.wait_for(Bus.open(nats_url, "test-client", declare=False), FAST)
    await bus.close()
    registry = await open_registry(redis_url)
    await registry.close()
    client = TrajectoryClient(nats_url, durable="test-connecting", task_ids=["none"])
    await asyncio.wait_for(client.connect(), FAST)
    await client.delete_consumer()
    await client.close()


# -- refused credentials: stop at once, say what to do --------------------------------
@pytest.fixture
def locked_nats(tmp_path):
    port = free_port()
    proc = localservers.start_nats(port, tmp_path / "nats", users={"cli": "right"})
    yield f"nats://127.0.0.1:{port}"
    localservers.stop_process(proc.pid)


async def test_a_client_whose_credentials_are_refused_stops_at_once_saying_what_to_do(
    locked_nats,
):
    wrong = locked_nats.replace("nats://", "nats://cli:wrong@")
    for connect in (
        lambda: Bus.open(wrong, "refused"),  # services' and the trainer's bus
        lambda: TrajectoryClient(wrong, durable="refused").connect(),  # a user's trainer
    ):
        with pytest.raises(CredentialsRefused) as refused:
            await asyncio.wait_for(connect(), FAST)  # before: 'Authorization Violation' forever
        message = str(refused.value)
        assert "refused the credentials for user 'cli'" in message, message
        assert "polar credentials show" in message and "--state-dir" in message
        assert "wrong" not in message  # the password is redacted

    with pytest.raises(CredentialsRefused, match="wants credentials and none were given"):
        await asyncio.wait_for(Bus.open(locked_nats, "no-credentials"), FAST)
    with pytest.raises(Unreachable, match="refused the credentials for user 'cli'"):
        await open_bus(wrong)  # the CLI's own connection says the same

    ok = await Bus.open(locked_nats.replace("nats://", "nats://cli:right@"), "right")
    await ok.close()


def test_polar_train_with_refused_credentials_exits_saying_what_to_do(locked_nats, tmp_path):
    """It printed `nats: 'Authorization Violation'` forever (issue 38.1)."""
    from tests.unit.engine.tiny import tiny_model_dir

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"instruction": "hi"}\n')
    config = tmp_path / "train.json"
    config.write_text(
        json.dumps(
            {
                "nats_url": locked_nats.replace("nats://", "nats://cli:stale@"),
                "tasks": {"path": str(tasks)},
                "model_dir": str(tiny_model_dir()),
                "checkpoint_dir": str(tmp_path / "ckpt"),
            }
        )
    )
    r = run_polar("train", str(config), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refused the credentials for user 'cli'" in r.stderr
    assert "polar credentials show" in r.stderr


# -- the stack `polar up` started ------------------------------------------------------
def test_up_writes_the_clients_environment_file(polar):
    assert polar.env_file.stat().st_mode & 0o777 == 0o600  # it holds the credentials
    values = read_env_file(polar.env_file)
    creds = credentials.load(polar.state)
    assert values["POLAR_NATS_URL"] == creds.nats_url(f"nats://127.0.0.1:{polar.ports['nats']}")
    assert values["POLAR_REDIS_URL"] == creds.redis_url(
        f"redis://127.0.0.1:{polar.ports['redis']}/0"
    )
    assert values["POLAR_ADMIN_TOKEN"] == creds.admin_token
    assert values["POLAR_READ_TOKEN"] == creds.read_token
    assert values["POLAR_SCHEDULER_URL"] == f"http://127.0.0.1:{polar.ports['scheduler']}"
    assert values["POLAR_STATE_DIR"] == str(polar.state)
    assert set(values) <= set(VARIABLES.values())

    # `polar credentials show` prints the same
    shown = polar("credentials", "show")
    assert f"POLAR_NATS_URL={values['POLAR_NATS_URL']}" in shown
    assert f"POLAR_ADMIN_TOKEN={creds.admin_token}" in shown

    # a user's program given only the file signs in (services.client.connection)
    env = {"POLAR_ENV_FILE": str(polar.env_file)}
    conn = from_environment(env)
    assert (conn.nats_url, conn.admin_token) == (values["POLAR_NATS_URL"], creds.admin_token)
    asyncio.run(signs_in(conn.nats_url, conn.redis_url))
    # and so does the CLI with no topology: the file names the stack's state dir
    stack = Stack.load(None, None, env=env)
    assert stack.state_dir == polar.state and stack.nats_url == values["POLAR_NATS_URL"]


def test_up_writes_a_nats_cli_context_and_leaves_the_users_own_alone(polar, tmp_path):
    contexts = polar.config_home / "nats" / "context"
    path = contexts / "polar.json"
    context = json.loads(path.read_text())
    assert path.stat().st_mode & 0o777 == 0o600
    creds = credentials.load(polar.state)
    assert context["url"] == f"nats://127.0.0.1:{polar.ports['nats']}"  # no password in it
    assert (context["user"], context["password"]) == ("cli", creds.nats_passwords["cli"])
    assert context["description"].startswith("Polar stack in ")
    for field in ("token", "creds", "nkey", "cert", "key", "ca", "jetstream_domain"):
        assert context[field] == ""  # the nats CLI's own fields, unset

    async def sign_in_as_the_nats_cli_does() -> None:  # url, then user and password
        nc = await nats.connect(context["url"], user=context["user"], password=context["password"])
        await nc.close()

    asyncio.run(sign_in_as_the_nats_cli_does())

    # a user's own context of another name, and one named `polar`, are never replaced
    other = contexts / "mine.json"
    other.write_text('{"url": "nats://elsewhere:4222"}')
    (polar.config_home / "nats" / "context.txt").write_text("mine")
    again = polar("up")  # the stack runs: a no-op that writes the context again
    assert "nats --context polar" in again
    assert other.read_text() == '{"url": "nats://elsewhere:4222"}'
    assert (polar.config_home / "nats" / "context.txt").read_text() == "mine"
    path.write_text('{"description": "my own", "url": "nats://mine:4222"}')
    kept = polar.run("up")
    assert kept.returncode == 0 and "is not a context polar wrote" in kept.stderr
    assert json.loads(path.read_text())["description"] == "my own"
    path.unlink()


async def test_a_bus_submission_named_by_its_msg_id_shows_in_polar_status(polar):
    nc = await nats.connect(polar.client_urls()[0])
    accepted: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(S.TASKS_ACCEPTED, cb=accepted.put)
    task = b'{"instruction": "hi", "num_samples": 2}'  # as `nats pub -H Nats-Msg-Id:...` sends
    await nc.publish(S.TASKS_SUBMIT, task, headers={"Nats-Msg-Id": "bus-task-1"})
    while True:  # the accepted event names the task by the id the publisher chose
        event = decode((await asyncio.wait_for(accepted.get(), 30)).data, TaskAccepted)
        if event.task_id == "bus-task-1":
            break
    await nc.close()
    assert len(event.session_ids) == 2

    report = json.loads(await asyncio.to_thread(polar, "status", "--json"))
    tasks = {t["task_id"]: t for t in report["tasks"]}
    assert tasks["bus-task-1"]["status"] == "active"
    assert tasks["bus-task-1"]["counts"] == {"REGISTERED": 2}
    text = await asyncio.to_thread(polar, "status")
    assert "bus-task-1" in text and "REGISTERED=2" in text


def test_credentials_survive_a_restart_and_a_client_of_the_first_run_still_connects(polar):
    before = credentials.load(polar.state)
    first_run = polar.client_urls()  # what a client was configured with
    polar("down")
    polar("up")
    assert credentials.load(polar.state) == before
    assert read_env_file(polar.env_file)["POLAR_NATS_URL"] == first_run[0]
    asyncio.run(signs_in(*first_run))


def test_rotation_is_explicit_and_a_client_with_the_old_ones_is_told_what_to_do(polar):
    old = credentials.load(polar.state)
    old_nats = polar.client_urls()[0]
    said = polar("credentials", "rotate")
    assert "the running stack still uses the old ones: restart it" in said
    polar("down")
    polar("up")
    new = credentials.load(polar.state)
    assert new.nats_passwords["cli"] != old.nats_passwords["cli"]
    assert new.admin_token != old.admin_token
    assert read_env_file(polar.env_file)["POLAR_NATS_URL"] == polar.client_urls()[0]
    asyncio.run(signs_in(*polar.client_urls()))

    async def refused() -> str:
        t0 = time.monotonic()
        with pytest.raises(CredentialsRefused) as caught:
            await asyncio.wait_for(TrajectoryClient(old_nats).connect(), FAST)
        assert time.monotonic() - t0 < FAST
        return str(caught.value)

    assert "refused the credentials for user 'cli'" in asyncio.run(refused())
    report = json.loads(polar("status", "--json"))  # the CLI reads the new ones
    assert report["errors"] == []


# -- port 0: the same ports again after a restart ----------------------------------------
def test_a_restart_gives_port_0_the_same_ports_and_a_running_client_reconnects(tmp_path):
    """`port: 0` is a free port chosen at `polar up`; a restart of the same stack picks the
    one it had, so a client left running (a `polar train` across `polar down` / `polar
    up`) reconnects instead of retrying a port nothing will listen on again."""
    cli = Polar(tmp_path)
    cli.topology.write_text(
        f"nats_url: nats://127.0.0.1:0\nredis_url: redis://127.0.0.1:0/0\n"
        f"state_dir: {cli.state}\n{only_scheduler(0)}"
    )
    cli("up")
    try:
        first = read_env_file(cli.env_file)
        asyncio.run(_survives_a_restart(cli, first["POLAR_NATS_URL"]))
        assert read_env_file(cli.env_file) == first  # URLs and credentials alike
    finally:
        cli.run("down")


async def _survives_a_restart(cli: Polar, nats_url: str) -> None:
    bus = await asyncio.wait_for(Bus.open(nats_url, "test-running", declare=False), FAST)
    try:
        await asyncio.to_thread(cli, "down")
        await asyncio.to_thread(cli, "up")
        got = await bus.nc.subscribe("polar.test.after-restart", max_msgs=1)
        await bus.nc.publish("polar.test.after-restart", b"back")
        # bounds a hang only: the reconnect is nats-py's own (every 2 s)
        msg = await got.next_msg(timeout=60)
        assert msg.data == b"back"
    finally:
        await bus.close()
