"""What `just demo` tells a first-time user about what it runs on (issue 38.13): the
servers it started for itself, the sandbox it chose, and output that survives a redirect."""

import subprocess
import sys

from infra.stackstate import Proc, StackState
from services.demo import family
from services.demo.run import sandbox_line, servers_line


def _proc(name: str, port: int, started: bool) -> Proc:
    return Proc(name=name, pid=1 if started else None, start_ticks=None,
                url=f"x://127.0.0.1:{port}", port=port, started=started)  # fmt: skip


def _state(*procs: Proc) -> StackState:
    return StackState(state_dir="/s", created_at=0.0, procs=list(procs))


def test_the_servers_the_demo_started_for_itself_are_named_with_their_ports():
    line = servers_line(_state(_proc("nats", 4001, True), _proc("redis", 4002, True)))
    assert line == (
        "started its own NATS JetStream (nats-server) on 127.0.0.1:4001 and Valkey on "
        "127.0.0.1:4002: they stop with the demo"
    )


def test_servers_it_reused_are_not_claimed_as_its_own():
    assert servers_line(_state(_proc("nats", 4222, False), _proc("redis", 6379, False))) is None
    only = servers_line(_state(_proc("nats", 4222, False), _proc("redis", 4002, True)))
    assert only is not None and "NATS" not in only and "Valkey on 127.0.0.1:4002" in only


def test_without_bubblewrap_the_demo_names_its_choice_once_and_the_templates_carry_it():
    assert "bubblewrap is not installed (`just setup` installs it)" in sandbox_line("none")
    assert sandbox_line("bwrap").startswith("sandbox: bubblewrap")
    train = family.training_templates("stars", 0, tasks=2, questions=4, sandbox="none")
    held = family.heldout_templates("stars", sandbox="none")
    assert {t["runtime"]["sandbox"] for t in train + held} == {"none"}
    # an explicit choice is not the `auto` the services warn about (factory.py)
    assert family.training_templates("stars", 0, tasks=1)[0]["runtime"]["sandbox"] == "auto"


def test_redirected_output_is_not_cut_at_80_columns():
    code = (
        "from rich.table import Table; from services.cli.main import out; t = Table('held-out "
        "accuracy', 'logprob drift'); t.add_row('0.787', '5e-06'); out.print(t); "
        "out.print('word ' * 30)"
    )
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    assert "held-out accuracy" in text and "logprob drift" in text
    assert ("word " * 30).strip() in text  # one line: not wrapped at 80
