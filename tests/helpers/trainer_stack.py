"""A stack for trainer tests: every service on free ports, the embedded engine sampling
from a tiny model of the test's own (no scripted policy), a trivial one-call agent."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from infra import credentials, devstack, localservers
from infra.topology import Topology, parse_topology
from tests.unit.engine.tiny import tiny_model_dir

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "trainer"
SERVICES = ("model", "proxy", "scheduler", "pool", "executor", "builder", "evaluator", "dashboard")


def model_copy(dest: Path) -> Path:
    """The tiny model directory, copied (the engine may be swapped to other weights)."""
    shutil.copytree(tiny_model_dir(), dest)
    return dest


def topology_yaml(state_dir: Path, model_dir: Path, max_run: int = 4) -> str:
    ports = {name: localservers.free_port() for name in ("nats", "redis", *SERVICES)}
    proxy_url = f"http://127.0.0.1:{ports['proxy']}"
    node_cfg = f"{{work_dir: '{state_dir / 'work'}', proxy_url: '{proxy_url}'}}"
    return f"""
nats_url: nats://127.0.0.1:{ports["nats"]}
redis_url: redis://127.0.0.1:{ports["redis"]}/0
state_dir: '{state_dir}'
startup_timeout_seconds: 180
nodes: [{{name: node0, max_init: {max_run}, ready_buffer: {max_run}, max_run: {max_run}}}]
backends: [{{name: embedded, kind: embedded, url: 'http://127.0.0.1:{ports["model"]}'}}]
services:
  model: {{port: {ports["model"]}, config: {{model_dir: '{model_dir}', served_model_name: tiny}}}}
  proxy: {{port: {ports["proxy"]}, config: {{mode: token, model_dir: '{model_dir}'}}}}
  scheduler: {{port: {ports["scheduler"]}}}
  pool: {{port: {ports["pool"]}, config: {node_cfg}}}
  executor: {{port: {ports["executor"]}, config: {node_cfg}}}
  builder: {{port: {ports["builder"]}}}
  evaluator: {{port: {ports["evaluator"]}, config: {node_cfg}}}
  dashboard: {{port: {ports["dashboard"]}}}
"""


def start_stack(state_dir: Path, max_run: int = 4) -> tuple[Topology, Path, str]:
    """(topology, the model dir the engine serves, the proxy's URL); stop with
    ``devstack.down(state_dir)``."""
    model_dir = model_copy(state_dir / "model")
    topo = parse_topology(topology_yaml(state_dir, model_dir, max_run), "trainer test")
    devstack.up(topo)
    port = topo.services["proxy"].port
    return topo, model_dir, f"http://127.0.0.1:{port}"


def stack_credentials(topo: Topology) -> credentials.Credentials:
    """What ``polar up`` generated for the stack (the trainer's NATS user, the admin token)."""
    creds = credentials.load(devstack.state_dir_of(topo))
    assert creds is not None, "start the stack first"
    return creds


def admin_headers(topo: Topology) -> dict[str, str]:
    return {"authorization": f"Bearer {stack_credentials(topo).admin_token}"}


def operator_nats(topo: Topology) -> str:
    """The stack's NATS URL as the operator's tools sign in (the ``cli`` user)."""
    return stack_credentials(topo).nats_url(topo.nats_url)


def agent_template(instruction: str, max_tokens: int = 4, temperature: float = 1.0) -> dict:
    """A task template: the trivial agent, scored by score.py (a reward per distinct answer)."""
    python = sys.executable
    return {
        "instruction": instruction,
        "timeout_seconds": 300,
        "agent_timeout_seconds": 120,
        "runtime": {
            "backend": "local",
            "prepare": [
                {"action": "upload_file", "src": str(FIXTURES / "agent.py"), "dest": "agent.py"},
                {"action": "upload_file", "src": str(FIXTURES / "score.py"), "dest": "score.py"},
            ],
        },
        "agent": {
            "harness": "shell",
            "command": f"{python} agent.py",
            "model": "tiny",
            "env": {"POLAR_MAX_TOKENS": str(max_tokens), "POLAR_TEMPERATURE": str(temperature)},
        },
        "builder": {"name": "prefix_merging"},
        "evaluator": {"name": "command", "config": {"command": f"{python} score.py"}},
    }


def trainer_config(topo: Topology, model_dir: Path, proxy_url: str, out: Path, **over) -> dict:
    tasks = out / "tasks.jsonl"
    if not tasks.exists():
        import json

        out.mkdir(parents=True, exist_ok=True)
        words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
        tasks.write_text(
            "".join(json.dumps(agent_template(f"say {w}")) + "\n" for w in words), "utf-8"
        )
    creds = stack_credentials(topo)
    return {
        "nats_url": creds.nats_url(topo.nats_url, "trainer"),
        "redis_url": creds.redis_url(topo.redis_url),
        "admin_token": creds.admin_token,
        "run_id": "t",
        "tasks": {"path": str(tasks), "heldout": 2},
        "model_dir": str(model_dir),
        "checkpoint_dir": str(out / "ckpt"),
        "proxy_url": proxy_url,
        "steps": 3,
        "groups_per_step": 2,
        "group_size": 4,
        "lr": 1e-3,
        "eval": {"every": 0, "at_start": False, "at_end": False},
        **over,
    }
