"""The CLI's wiring without servers: errors it reports and the config `serve` builds."""

import json

import pytest
from typer.testing import CliRunner

from services.cli import main

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(main.app, list(args), env={"COLUMNS": "200"})


def test_unknown_service_is_refused_naming_the_known_ones():
    r = invoke("serve", "nosuch")
    assert r.exit_code == 1
    assert "unknown service 'nosuch'; known: " in r.output
    assert all(name in r.output for name in ("scheduler", "proxy", "pool", "executor"))


def test_a_topology_typo_is_an_error_naming_the_key(tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text("servics: {}\n")
    r = invoke("up", "--topology", str(topo), "--state-dir", str(tmp_path))
    assert r.exit_code == 1 and "unknown field `servics`" in r.output


def test_down_without_a_stack_is_a_no_op(tmp_path):
    r = invoke("down", "--state-dir", str(tmp_path))
    assert r.exit_code == 0 and "no stack was running" in r.output


def test_submit_refuses_a_file_it_cannot_read(tmp_path):
    (tmp_path / "task.txt").write_text("{}")
    r = invoke("submit", str(tmp_path / "task.txt"), "--state-dir", str(tmp_path))
    assert r.exit_code == 1 and "a task file ends in .json, .yaml or .yml" in r.output


def test_submit_checks_a_file_before_it_connects(tmp_path):
    task = tmp_path / "t.json"
    task.write_text('{"instruction": "x", "agent": {"harness": "noop", "modle": "m"}}')
    r = invoke("submit", str(task), "--state-dir", str(tmp_path))
    assert r.exit_code == 1
    assert "rejected (local check) at $.agent.modle: Unknown field" in r.output


def test_serve_config_from_polar_config_with_overrides(monkeypatch):
    given = {
        "nats_url": "nats://a:1",
        "port": 8100,
        "host": "127.0.0.1",
        "reconcile_interval_seconds": 1,
    }
    monkeypatch.setenv("POLAR_CONFIG", json.dumps(given))
    assert main._serve_config("scheduler", None, None, None) == given
    assert main._serve_config("scheduler", None, "0.0.0.0", 9001) == {
        **given,
        "host": "0.0.0.0",
        "port": 9001,
    }
    assert main._serve_config("scheduler", None, None, 0)["port"] > 0  # a free port


def test_serve_config_from_the_topology_without_polar_config(monkeypatch, tmp_path):
    monkeypatch.delenv("POLAR_CONFIG", raising=False)
    topo = tmp_path / "t.yaml"
    topo.write_text("redis_url: redis://127.0.0.1:7/0\nservices: {scheduler: {port: 8123}}\n")
    config = main._serve_config("scheduler", topo, None, None)
    assert (config["redis_url"], config["port"], config["node"]) == (
        "redis://127.0.0.1:7/0",
        8123,
        "node0",
    )


@pytest.mark.parametrize("args", [("model", "--help"), ("model",)])
def test_model_commands_come_from_the_embedded_server(args):
    """`polar model` is the embedded server's own CLI (services/engine/cli.py)."""
    r = invoke(*args)
    assert "init" in r.output and "serve" in r.output


def test_train_reports_a_bad_config_with_status_1(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("tasks: {path: t.jsonl}\nmodel_dir: m\ncheckpoint_dir: c\nlrr: 1\n")
    r = invoke("train", str(cfg))
    assert r.exit_code == 1 and "lrr" in r.output
    r = invoke("train", str(tmp_path / "missing.yaml"))
    assert r.exit_code == 1 and "cannot read" in r.output


def test_train_reports_a_task_source_it_cannot_read(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(f"tasks: {{path: {tmp_path}/none.jsonl}}\nmodel_dir: m\ncheckpoint_dir: c\n")
    r = invoke("train", str(cfg))
    assert r.exit_code == 1 and "cannot read" in r.output and "none.jsonl" in r.output


def test_train_reports_a_model_dir_it_cannot_load(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"instruction": "x"}\n')
    cfg = tmp_path / "t.yaml"
    cfg.write_text(
        f"tasks: {{path: {tmp_path}/t.jsonl}}\nmodel_dir: {tmp_path}/m\ncheckpoint_dir: c\n"
    )
    r = invoke("train", str(cfg))
    assert r.exit_code == 1 and "model_dir" in r.output and "no config.json" in r.output


def test_a_foreground_dashboard_reads_with_the_stacks_token_or_one_of_its_own(tmp_path):
    """`polar dashboard --port`: the stack's tokens when `polar up` made them, else a read
    token of this process's own, in the sign-in link it prints (never an open dashboard)."""
    import re
    import time

    from infra import credentials
    from infra.stackstate import StackState, write_state
    from services.cli.context import Stack
    from services.common.auth import Ticket, Tickets

    topo = tmp_path / "t.yaml"
    topo.write_text(f"state_dir: {tmp_path}\n")
    alone = main._dashboard_config(Stack.load(topo, None), None, 0)
    assert alone["read_token"].startswith("pr_") and "admin_token" not in alone

    write_state(StackState(state_dir=str(tmp_path), created_at=time.time()))
    creds = credentials.generate([], own_nats=False, own_redis=False)
    credentials.save(tmp_path, creds)
    stack = Stack.load(topo, None)
    config = main._dashboard_config(stack, None, 0)
    assert config["read_token"] == creds.read_token
    assert config["admin_token"] == creds.admin_token  # its cancel
    assert main._dashboard_key(stack) == creds.read_token

    with main.out.capture() as printed:
        main._print_sign_in("dashboard", "http://127.0.0.1:8160/", creds.read_token)
    link = re.search(r"http://127\.0\.0\.1:8160/\?token=(\S+)", printed.get())
    assert link and creds.read_token not in printed.get()
    book = Tickets([creds.read_token], "dashboard", "")
    assert isinstance(book.verify(link[1], now=time.time()), Ticket)


def test_admin_token_is_the_stacks_else_polar_admin_token(tmp_path, monkeypatch):
    """`polar submit --via http` against a deployment (compose, Kubernetes, Slurm: no
    `polar up` record) presents POLAR_ADMIN_TOKEN, as the deployment's services take it;
    a stack `polar up` started presents its own generated token."""
    import time

    from infra import credentials
    from infra.stackstate import StackState, write_state
    from services.cli.context import Stack

    topo = tmp_path / "t.yaml"
    topo.write_text(f"state_dir: {tmp_path}\n")
    monkeypatch.delenv("POLAR_ADMIN_TOKEN", raising=False)
    assert Stack.load(topo, None).admin_token is None
    monkeypatch.setenv("POLAR_ADMIN_TOKEN", "")
    assert Stack.load(topo, None).admin_token is None
    monkeypatch.setenv("POLAR_ADMIN_TOKEN", "pa_deployed")
    assert Stack.load(topo, None).admin_token == "pa_deployed"

    write_state(StackState(state_dir=str(tmp_path), created_at=time.time()))
    creds = credentials.generate([], own_nats=False, own_redis=False)
    credentials.save(tmp_path, creds)
    assert Stack.load(topo, None).admin_token == creds.admin_token
