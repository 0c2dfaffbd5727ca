"""The services the dev stack can run: one row each.

Adding a service to ``polar up`` / ``polar serve`` is one line in ``SERVICES``. A row
names the ASGI app factory (``module:callable``, called with no arguments; it reads its
settings from ``POLAR_CONFIG``), its default port, and, optionally:

- ``per_node``: one process per topology node (ports: base port + node index), with the
  node's name in ``node``;
- ``opt_in``: not started unless the topology's ``services`` has an entry for it (the
  trainer needs its own config: a task source and a model);
- ``takes``: extra topology fields the service's config accepts, merged into its
  ``POLAR_CONFIG`` — node pool sizes (``max_init``, ``ready_buffer``, ``max_run``) and/or
  ``backends``. Only listed fields are passed: service configs reject unknown keys;
- ``proxy_url``: the service talks to the proxy (sandboxes sent there, weights pushed
  there), so ``polar up`` gives it the stack's proxy URL (``infra/wiring.py``);
- ``work_dir``: the service keeps session work dirs, so ``polar up`` gives it a
  ``work_dir`` under the state dir.
"""

from __future__ import annotations

from typing import NamedTuple

NODE_FIELDS = ("max_init", "ready_buffer", "max_run")
TOPOLOGY_FIELDS = ("backends",)


class ServiceKind(NamedTuple):
    target: str  # "module:create_app"
    port: int  # default port (per-node services: the first node's)
    per_node: bool = False
    takes: tuple[str, ...] = ()
    native: bool = False  # a ProxyApp served by proxy.io.native, else ASGI under granian
    proxy_url: bool = False  # given the stack's proxy URL
    work_dir: bool = False  # given a work_dir under the state dir
    opt_in: bool = False  # runs only when the topology's `services` names it


SERVICES: dict[str, ServiceKind] = {
    # the embedded CPU model server (SGLang surface); disable it when backends are GPUs
    "model": ServiceKind("services.engine.main:create_app", 30000),
    # the harnesses' model API: token-exact capture in front of the inference engine
    "proxy": ServiceKind("proxy.main:create_app", 8200, takes=TOPOLOGY_FIELDS, native=True),
    # the task front door: HTTP API + polar.tasks.* consumers
    "scheduler": ServiceKind("services.scheduler.main:create_app", 8100),
    # INIT stage per node: sandboxes prepared ahead into the READY buffer
    "pool": ServiceKind(
        "services.pool.main:create_app",
        8110,
        per_node=True,
        takes=NODE_FIELDS + TOPOLOGY_FIELDS,
        proxy_url=True,
        work_dir=True,
    ),
    # RUNNING stage per node: harnesses run, deadlines enforced, artifacts collected
    "executor": ServiceKind(
        "services.executor.main:create_app",
        8120,
        per_node=True,
        takes=NODE_FIELDS,
        proxy_url=True,
        work_dir=True,
    ),
    # POSTRUN: completions -> trajectories
    "builder": ServiceKind("services.builder.main:create_app", 8130),
    # rewards, then exactly-once delivery to polar.trajectories.<task>
    "evaluator": ServiceKind(
        "services.evaluator.main:create_app", 8140, proxy_url=True, work_dir=True
    ),
    # the RL loop: tasks out, groups in, policy-gradient steps, weights to the engines
    # (not in the default topology: it needs a task source and a model to train)
    "trainer": ServiceKind("services.trainer.main:create_app", 8150, opt_in=True, proxy_url=True),
    # what people look at: tasks, sessions, model calls, tokens, rewards, live (read-only
    # but for cancel); `polar up` tells it the state dir, tokenizer and trainer log
    "dashboard": ServiceKind("services.dashboard.main:create_app", 8160, takes=TOPOLOGY_FIELDS),
}


def check_catalog(services: dict[str, ServiceKind]) -> None:
    """Fail fast on a row that names a field no topology has (a typo in ``takes``)."""
    known = set(NODE_FIELDS) | set(TOPOLOGY_FIELDS)
    for name, kind in services.items():
        bad = [f for f in kind.takes if f not in known]
        if bad:
            raise ValueError(
                f"service {name!r}: unknown `takes` field(s) {bad}; known: {sorted(known)}"
            )
        if ":" not in kind.target:
            raise ValueError(f"service {name!r}: target {kind.target!r} is not 'module:callable'")
