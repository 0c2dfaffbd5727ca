"""Where a client finds the stack (services/client/connection.py) and the `nats` CLI
context `polar up` writes (infra/natscontext.py): files only, no servers."""

from __future__ import annotations

import json

import pytest

from infra import credentials, natscontext
from services.client.connection import Connection, from_environment, read_env_file
from services.trainer.config import stack_defaults


def test_the_environment_file_round_trips_and_sources_in_sh(tmp_path):
    conn = Connection(
        nats_url="nats://cli:p-w_1@127.0.0.1:4222",
        redis_url="redis://:r-2@127.0.0.1:6379/0",
        admin_token="pa_x",
        state_dir="/tmp/a dir/with spaces",
    )
    path = tmp_path / "polar.env"
    path.write_text(conn.env_file("written by a test\nsecond line"))
    assert Connection.of(read_env_file(path)) == conn
    assert "POLAR_STATE_DIR='/tmp/a dir/with spaces'" in path.read_text()  # sh-quoted
    assert "POLAR_PROXY_URL" not in path.read_text()  # unknown: not written


def test_a_variable_set_in_the_environment_wins_over_the_file(tmp_path):
    path = tmp_path / "polar.env"
    path.write_text("export POLAR_NATS_URL=nats://file:1@h:4222\nPOLAR_ADMIN_TOKEN=pa_file\n")
    env = {"POLAR_ENV_FILE": str(path), "POLAR_ADMIN_TOKEN": "pa_env"}
    conn = from_environment(env)
    assert (conn.nats_url, conn.admin_token) == ("nats://file:1@h:4222", "pa_env")
    assert not from_environment({}).known


def test_polar_train_fills_only_what_a_stack_knows():
    conn = Connection(nats_url="nats://trainer:x@h:1", proxy_url="http://h:2", state_dir="/s")
    assert stack_defaults(conn) == {"nats_url": "nats://trainer:x@h:1", "proxy_url": "http://h:2"}


def test_the_credentials_outlive_a_restart_and_rotate_only_when_asked(tmp_path):
    users = ["scheduler", "cli"]
    first = credentials.for_stack(tmp_path, users)
    credentials.save(tmp_path, first)
    assert credentials.for_stack(tmp_path, users) == first
    grown = credentials.for_stack(tmp_path, [*users, "trainer"])  # a user the catalog gained
    assert grown.nats_passwords["cli"] == first.nats_passwords["cli"]
    assert set(grown.nats_passwords) == {"scheduler", "cli", "trainer"}
    rotated = credentials.rotate(tmp_path)
    assert credentials.load(tmp_path) == rotated
    assert rotated.admin_token != first.admin_token
    assert set(rotated.nats_passwords) == set(first.nats_passwords)
    assert rotated.nats_passwords["cli"] != first.nats_passwords["cli"]


def test_the_nats_context_is_the_cli_format_and_never_a_users_own(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    url = "nats://cli:s%2Fecret@10.0.0.1:4222,nats://10.0.0.2:4222"
    path = natscontext.write_context("polar", url, tmp_path / "state", env)
    assert path == tmp_path / "nats" / "context" / "polar.json"
    assert path.stat().st_mode & 0o777 == 0o600
    data = json.loads(path.read_text())
    assert data["url"] == "nats://10.0.0.1:4222,nats://10.0.0.2:4222"
    assert (data["user"], data["password"]) == ("cli", "s/ecret")
    assert set(natscontext.FIELDS) == set(data)
    natscontext.write_context("polar", url, tmp_path / "state", env)  # ours: rewritten

    path.write_text('{"description": "mine", "url": "nats://x:4222"}')
    with pytest.raises(natscontext.ContextTaken):
        natscontext.write_context("polar", url, tmp_path / "state", env)
    assert json.loads(path.read_text())["description"] == "mine"
    with pytest.raises(ValueError):
        natscontext.context_path("../escape", env)
