"""The dev stack: ``polar up`` / ``polar down``.

``up`` uses the NATS and Redis at the topology's URLs when something listens there,
otherwise starts its own nats-server (JetStream, files under the state dir) and Valkey
on those ports; then starts each enabled service as its own process
(``python -m services.cli.main serve <service>``), waits for every ``/healthz``, and
records all of it in ``<state_dir>/stack.json``. The credentials it gives them are the
state dir's own (``infra/credentials.py``: kept across restarts), and once every service
is healthy it writes its clients' environment file ``<state_dir>/polar.env``
(``services/client/connection.py``). ``down`` stops exactly what ``up`` started — nothing
it found already running — and checks no port of it still listens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec

from infra import credentials, localservers, usercache, wiring
from infra.catalog import SERVICES
from infra.credentials import Credentials
from infra.stackstate import (
    Proc,
    StackState,
    proc_alive,
    read_state,
    remove_state,
    split_alive,
    start_ticks,
    stop_group,
    write_state,
)
from infra.topology import ServicePlan, Topology, plan_services
from services.client import connection
from services.common.settings import ENGINE_KEY_ENV, ENV_SECRETS
from services.node.harnesses.install import CACHE_ENV as HARNESS_CACHE_ENV

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", ""})
Log = Callable[[str], None]


class StackError(RuntimeError):
    pass


@dataclass
class DownReport:
    stopped: list[str] = field(default_factory=list)
    already_gone: list[str] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)  # reused, not ours
    still_listening: list[int] = field(default_factory=list)


def state_dir_of(topo: Topology) -> Path:
    return Path(topo.state_dir).resolve()


def _quiet(_: str) -> None:
    pass


# -- up -------------------------------------------------------------------------------
def up(topo: Topology, *, log: Log = _quiet) -> StackState:
    """Start the stack, or return the running one. Raises StackError, having stopped
    whatever it started, when something does not come up."""
    state_dir = state_dir_of(topo)
    running = _existing(state_dir, log)
    if running is not None:
        return running
    ports = localservers.StickyPorts(state_dir)
    topo = wiring.with_server_ports(topo, ports)
    plans = wiring.with_ports(plan_services(topo), ports)
    plans = wiring.wire(plans, topo, state_dir)
    problems = wiring.cannot_work(plans)
    if problems:  # before anything starts: nothing to stop, nothing half up
        raise StackError("this topology cannot work:\n- " + "\n- ".join(problems))
    _check_ports_free(plans, topo.host)
    state = StackState(state_dir=str(state_dir), created_at=time.time())
    # the credentials of the stack's last start, if any: its clients keep signing in
    creds = credentials.for_stack(state_dir, [*SERVICES, credentials.OPERATOR])
    try:
        own_nats = _ensure_server(
            state,
            "nats",
            topo.nats_url,
            4222,
            lambda port, where, host: localservers.start_nats(
                port, where, host, users=creds.nats_passwords
            ),
            log,
        )
        own_redis = _ensure_server(
            state,
            "redis",
            topo.redis_url,
            6379,
            lambda port, where, host: localservers.start_valkey(
                port, where, host, password=creds.redis_password
            ),
            log,
        )
        creds = _only_own(creds, own_nats, own_redis)
        credentials.save(state_dir, creds)
        plans = wiring.with_credentials(plans, creds, topo.host)
        spawned = [(plan, _start_service(state, plan, topo, creds, log)) for plan in plans]
        deadline = time.monotonic() + topo.startup_timeout_seconds
        _wait_healthy(spawned, wiring.connect_host(topo.host), deadline, state_dir, log)
        write_env_file(state_dir, client_connection(topo, plans, creds, state_dir))
        ports.save()
    except BaseException:
        log("start failed: stopping what was started")
        down(state_dir)
        raise
    return state


def _only_own(creds: Credentials, own_nats: bool, own_redis: bool) -> Credentials:
    """The credentials without passwords for servers the stack found running (the
    operator's: their URLs carry whatever credentials they need)."""
    return msgspec.structs.replace(
        creds,
        nats_passwords=creds.nats_passwords if own_nats else {},
        redis_password=creds.redis_password if own_redis else None,
    )


def env_file(state_dir: Path) -> Path:
    """The environment file ``up`` writes for the stack's clients (``services.client``)."""
    return Path(state_dir) / connection.ENV_FILE


def client_connection(
    topo: Topology, plans: list[ServicePlan], creds: Credentials, state_dir: Path
) -> connection.Connection:
    """How the operator's tools and a user's own programs reach the stack: its URLs with
    the operator's credentials, the tokens, the services' addresses."""
    return connection.Connection(
        nats_url=creds.nats_url(topo.nats_url),
        redis_url=creds.redis_url(topo.redis_url),
        admin_token=creds.admin_token,
        read_token=creds.read_token,
        proxy_url=wiring.service_url(plans, wiring.PROXY, topo.host),
        scheduler_url=wiring.service_url(plans, "scheduler", topo.host),
        dashboard_url=wiring.service_url(plans, wiring.DASHBOARD, topo.host),
        state_dir=str(state_dir),
    )


def write_env_file(state_dir: Path, conn: connection.Connection) -> Path:
    """``<state_dir>/polar.env``, readable by its owner only (it holds the credentials)."""
    path = env_file(state_dir)
    header = (
        f"The stack in {state_dir}, written by `polar up` (its credentials: 0600).\n"
        f"A client reads it with POLAR_ENV_FILE={path}, or: set -a; . {path}; set +a"
    )
    credentials.write_private(path, conn.env_file(header).encode())
    return path


def client_urls(state_dir: Path, nats_url: str, redis_url: str) -> tuple[str, str]:
    """The NATS and Redis URLs the operator's tools (CLI, export, demo) sign in with."""
    creds = credentials.load(state_dir)
    if creds is None:
        return nats_url, redis_url
    return creds.nats_url(nats_url), creds.redis_url(redis_url)


def operator_view(topo: Topology) -> Topology:
    """``topo`` with the URLs the operator's tools sign in with (its stack running)."""
    nats_url, redis_url = client_urls(state_dir_of(topo), topo.nats_url, topo.redis_url)
    return msgspec.structs.replace(topo, nats_url=nats_url, redis_url=redis_url)


def _existing(state_dir: Path, log: Log) -> StackState | None:
    """The running stack; None when there is none (a stale record is cleaned)."""
    state = read_state(state_dir)
    if state is None:
        return None
    alive, dead = split_alive(state)
    if not dead:
        log(f"the stack in {state_dir} is already up")
        return state
    if alive:
        raise StackError(
            f"the stack in {state_dir} is partly down ({', '.join(p.name for p in dead)} "
            f"exited; {', '.join(p.name for p in alive)} still running): run `polar down` first"
        )
    log(f"removing a stale stack record in {state_dir} (none of its processes run)")
    down(state_dir)
    return None


def _check_ports_free(plans: list[ServicePlan], host: str) -> None:
    busy = [
        f"{p.name}:{p.port}"
        for p in plans
        if localservers.reachable(wiring.connect_host(host), p.port)
    ]
    if busy:
        raise StackError(f"port(s) already in use: {', '.join(busy)}; change them in topology.yaml")


def _ensure_server(
    state: StackState, name: str, url: str, default_port: int, start, log: Log
) -> bool:
    """Use the server at ``url``, or start our own there; True when we started it."""
    if "," in url or "+sentinel" in url:  # a cluster: its own operators run it
        log(f"{name}: using the clustered servers at {url}")
        state.procs.append(
            Proc(name=name, pid=None, start_ticks=None, url=url, port=0, started=False)
        )
        write_state(state)
        return False
    host, port = localservers.host_port(url, default_port)
    if localservers.reachable(host, port):
        log(f"{name}: using the server at {url}")
        state.procs.append(
            Proc(name=name, pid=None, start_ticks=None, url=url, port=port, started=False)
        )
        write_state(state)
        return False
    if host not in LOCAL_HOSTS:
        raise StackError(
            f"{name} at {url} is unreachable, and it is not local: cannot start one there"
        )
    where = Path(state.state_dir) / name
    log(f"{name}: nothing at {url}; starting our own on port {port}")
    try:
        proc = start(port, where, host="127.0.0.1")
    except localservers.ServerStartError as exc:
        raise StackError(f"{name}: {exc}; log: {where}") from None
    log_name = "nats.log" if name == "nats" else "valkey.log"
    state.procs.append(_record(name, proc.pid, url, port, str(where / log_name)))
    write_state(state)
    return True


def _record(name: str, pid: int, url: str, port: int, log_path: str) -> Proc:
    return Proc(
        name=name,
        pid=pid,
        start_ticks=start_ticks(pid),
        url=url,
        port=port,
        started=True,
        log=log_path,
    )


def inherited_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a stack service inherits from ``polar up``'s environment: all but the token
    variables a deployment sets (``ENV_SECRETS``). This stack's credentials are its
    own (credentials.json, in each service's config); an operator's shell holding
    another stack's tokens must not reach its pools and executors, nor key its proxy's
    other embedded backends."""
    return {k: v for k, v in env.items() if k not in ENV_SECRETS}


def _judge_key(plan: ServicePlan, creds: Credentials) -> dict[str, str]:
    """The evaluator's rubric judge may call the stack's own engine (``api_key_env:
    POLAR_ENGINE_API_KEY``, examples/rubric): its key, in the evaluator's environment
    only, which its sandboxes never inherit (their environment is built)."""
    if plan.service != "evaluator" or not creds.engine_key:
        return {}
    return {ENGINE_KEY_ENV: creds.engine_key}


HARNESS_NODE_SERVICES = ("pool", "executor")  # install the CLIs; run them from the cache


def _shared_harness_cache(plan: ServicePlan, env: Mapping[str, str]) -> dict[str, str]:
    """The per-user CLI cache that `just setup` fills (``~/.cache/polar/harness-cache``)
    for the node services, unless the operator names one: each stack's pool installed
    every CLI again into its own state dir before (pi 33 s, opencode 20 s of INIT, ~350 MB
    per state dir; issue 38.9). Installs there are per package@version, safe to share."""
    if plan.service not in HARNESS_NODE_SERVICES or env.get(HARNESS_CACHE_ENV):
        return {}
    root = usercache.cache_root(env)
    return {} if root is None else {HARNESS_CACHE_ENV: str(root / "harness-cache")}


def _start_service(
    state: StackState, plan: ServicePlan, topo: Topology, creds: Credentials, log: Log
) -> subprocess.Popen:
    log_path = Path(state.state_dir) / "logs" / f"{plan.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **inherited_env(os.environ),
        "POLAR_CONFIG": json.dumps(plan.config),
        "POLAR_NATS_URL": creds.nats_url(topo.nats_url, plan.service),  # its own user
        "POLAR_REDIS_URL": creds.redis_url(topo.redis_url),
        "PYTHONUNBUFFERED": "1",
        **_judge_key(plan, creds),
        **_shared_harness_cache(plan, os.environ),
    }
    argv = [
        sys.executable,
        "-m",
        "services.cli.main",
        "serve",
        plan.service,
        "--host",
        topo.host,
        "--port",
        str(plan.port),
    ]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives `polar up`; `polar down` stops its group
        )
    url = f"http://{wiring.connect_host(topo.host)}:{plan.port}"
    state.procs.append(_record(plan.name, proc.pid, url, plan.port, str(log_path)))
    write_state(state)
    log(f"{plan.name}: started (pid {proc.pid}), log {log_path}")
    return proc


def log_tail(path: str | Path, lines: int = 30) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def healthz(url: str, timeout: float = 1.0) -> tuple[int | None, dict | str]:
    """(status, body) of ``url``/healthz; (None, why) when it does not answer."""
    try:
        r = httpx.get(f"{url}/healthz", timeout=timeout, trust_env=False)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text[:200]


_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Refused)(?:: .+)?$"
)


def startup_error(log_text: str) -> str | None:
    """The service's own reason for failing to start: the last exception line of the
    last traceback in its log (an exception group's innermost one), None when there is
    no traceback."""
    found = None
    seen_traceback = False
    for raw in log_text.splitlines():
        line = raw.lstrip(" |+-")
        if "Traceback (most recent call last)" in line:
            seen_traceback = True
        elif seen_traceback and _EXCEPTION_LINE.match(line) and "ExceptionGroup" not in line:
            found = line
    return found


def _exited(plan: ServicePlan, proc: subprocess.Popen, log_path: Path) -> StackError:
    try:
        why = startup_error(log_path.read_text(errors="replace"))
    except OSError:
        why = None
    return StackError(
        f"{plan.name} exited with code {proc.returncode} before it was healthy: "
        f"{why or 'no error in its log'}\nlast lines of {log_path}:\n{log_tail(log_path)}"
    )


def _wait_healthy(
    started: list[tuple[ServicePlan, subprocess.Popen]],
    host: str,
    deadline: float,
    state_dir: Path,
    log: Log,
) -> None:
    """Wait until every service answers /healthz; the first that exits meanwhile, in
    whatever order, fails the start at once with its own error."""
    pending = list(started)
    last: dict[str, object] = {}
    while pending and time.monotonic() < deadline:
        for plan, proc in list(pending):
            log_path = state_dir / "logs" / f"{plan.name}.log"
            if proc.poll() is not None:
                error = _exited(plan, proc, log_path)
                log(str(error).split("\n", 1)[0])
                raise error
            status, body = healthz(f"http://{host}:{plan.port}", timeout=0.5)
            # another process's server on that port (taken between the port's choice and
            # our bind) answers for nothing of ours: ours then exits on the bind
            if status == 200 and localservers.holds_port(proc.pid, plan.port):
                pending.remove((plan, proc))
                log(f"{plan.name} is healthy on port {plan.port}")
            elif status == 200:
                last[plan.name] = f"port {plan.port} answered by a process not started here"
            else:
                last[plan.name] = body if status is None else f"HTTP {status}: {body}"
        time.sleep(0.1)
    if pending:
        plan = pending[0][0]
        log_path = state_dir / "logs" / f"{plan.name}.log"
        raise StackError(
            f"{plan.name} was not healthy at http://{host}:{plan.port}/healthz in time "
            f"(last: {last.get(plan.name, 'no answer yet')}); "
            f"last lines of {log_path}:\n{log_tail(log_path)}"
        )


# -- down -----------------------------------------------------------------------------
def down(state_dir: Path) -> DownReport:
    """Stop what the stack in ``state_dir`` started (services first, then Redis, then
    NATS), remove its record, and report any port of it that still listens."""
    report = DownReport()
    state = read_state(state_dir)
    if state is None:
        return report
    for p in reversed(state.procs):
        if not p.started:
            report.left_running.append(p.name)
        elif stop_group(p):
            report.stopped.append(p.name)
        else:
            report.already_gone.append(p.name)
    report.still_listening = _listening([p.port for p in state.started()])
    remove_state(state_dir)
    return report


def _listening(ports: list[int], grace: float = 3.0) -> list[int]:
    """Ports still accepting connections after a short grace (sockets close async)."""
    deadline = time.monotonic() + grace
    while True:
        busy = [port for port in ports if localservers.reachable("127.0.0.1", port, 0.2)]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.1)


def alive_names(state: StackState) -> dict[str, bool]:
    """Each recorded process: running? (reused servers are not ours to judge: True)."""
    return {p.name: proc_alive(p) if p.started else True for p in state.procs}
