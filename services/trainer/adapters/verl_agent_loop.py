"""verl on Polar: any unmodified harness as verl's agent loop (docs/training.md, "verl").

``PolarAgentLoop`` is a verl ``AgentLoopBase``. verl names it in an agent-loop config
(``rollout.agent.agent_loop_config_path``: examples/verl_grpo/agent_loops.yaml, entry
``polar``) or through ``register_polar_loop()``. For each sample verl hands it, a Polar
session runs the task the ``polar:`` config section (and the sample's own
``polar_task`` field) describes: harness, runtime, evaluator. verl's ``n`` runs of one
prompt are one Polar task of ``num_samples = n`` (verl_sessions.py), so Polar's early
stop, priority, retries and group rules apply. Each run returns its session's main
trace as an ``AgentLoopOutput``: ``prompt_ids``/``response_ids`` as captured,
``response_mask`` = the loss mask, ``response_logprobs`` = the engine's logprobs,
``reward_score`` = the evaluator's reward, ``routed_experts`` when Polar captured MoE
routing, ``num_turns``, the seconds the group took as ``metrics.generate_sequences``,
and in ``extra_fields`` the session, task and trace ids, the outcome, the weight
version spans, and ``min_global_steps``/``max_global_steps`` (the versions as verl's
staleness control counts them).

A session that cannot stand in its group's baseline (``verl_sessions.exclusion``: its
runtime, harness or the system failed, it was cancelled, its evaluation failed, it
sampled nothing, or it never came back) reaches verl as:

- ``raise`` (verl's V1 trainer, ``trainer.use_v1: true``, the default in 0.9.1): the run
  raises ``PolarSessionFailed``. verl's V1 worker settles every run of the prompt, logs
  the error and marks the prompt's group ``failure``; the failed run puts no trajectory
  into its store, so the group's GRPO baseline is computed over the members that came
  back, and ``trainer.v1.sampler.sync_refill_failed_groups: true`` replaces a group left
  with none.
- ``mask`` (the legacy trainer, which cannot drop a row): a one-token row, fully
  masked (it trains nothing), whose reward is the mean of the members that stand (the
  group's mean does not move; its spread is computed over one more member).

Engines: ``PolarRouter`` is verl's request router (``rollout.router_config_path``:
examples/verl_grpo/router.yaml). verl builds it with every inference server it started
and tells it of servers it adds or removes; it keeps verl's own routing and also serves
Polar's proxy from those servers (``polar serve proxy`` in Polar's venv, token mode
with the served model's tokenizer). verl pauses and syncs its servers itself and records
each sync's step on them; before each group the loop has the router set that step as
each engine's weight version, which the proxy stamps on every call it captures.

Runs in verl's venv (infra/verl.py); imports verl, ``schemas`` and ``services.client``
(through verl_sessions.py), nothing else of Polar.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)
from verl.workers.rollout.router import GlobalRequestLoadBalancer

from services.client import connection as polar_connection
from services.trainer.adapters.verl_sessions import (
    Limits,
    VerlSettings,
    baseline,
    exclusion,
    groups_for,
    masked_fields,
    output_fields,
)

log = logging.getLogger("polar.verl")
REPO = Path(__file__).resolve().parents[3]


class PolarSessionFailed(RuntimeError):
    """A session that cannot stand in its group's baseline (verl's V1 trainer leaves
    the run out of its group)."""

    def __init__(self, why: str, session_id: str | None) -> None:
        super().__init__(f"polar session {session_id or '(missing)'}: {why}")
        self.why, self.session_id = why, session_id


def settings_of(config: Any) -> VerlSettings:
    """verl's ``polar:`` section as ``VerlSettings`` (unknown keys are an error)."""
    section = config.get("polar") if hasattr(config, "get") else None
    if section is None:
        raise ValueError("verl's config has no `polar:` section (examples/verl_grpo/README.md)")
    raw = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else section
    return msgspec.convert(raw, VerlSettings)


def failed_mode(settings: VerlSettings, config: Any) -> str:
    if settings.failed != "auto":
        return settings.failed
    trainer = config.get("trainer") or {}
    return "raise" if trainer.get("use_v1", True) else "mask"


class PolarAgentLoop(AgentLoopBase):
    """One verl run = one Polar session (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings_of(self.config)
        self.failed = failed_mode(self.settings, self.config)
        rollout = self.rollout_config
        self.limits = Limits(int(rollout.prompt_length), int(rollout.response_length))
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = 0 if pad is None else int(pad)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """``sampling_params`` are verl's; the harness samples as it always does."""
        groups = groups_for(self.settings)
        groups.before_submit = groups.before_submit or self._stamp_versions
        uid = str(kwargs.get("uid", kwargs.get("index")))
        got = await groups.session(uid, kwargs)  # joins before its first await
        step = int(kwargs.get("global_steps") or 0)
        why = exclusion(got.trajectory)
        if why is None:
            fields = output_fields(
                got.trajectory,
                self.limits,
                global_steps=step,
                seconds=got.seconds,
                routing=got.routing,
            )
        elif self.failed == "raise":
            raise PolarSessionFailed(why, got.trajectory and got.trajectory.session_id)
        else:
            fields = masked_fields(
                got.trajectory,
                why,
                baseline(got.members),
                pad_id=self.pad_id,
                global_steps=step,
                seconds=got.seconds,
            )
        metrics = AgentLoopMetrics(**fields.pop("metrics"))
        return AgentLoopOutput(**fields, metrics=metrics)

    async def _stamp_versions(self) -> None:
        """Have verl's router (``PolarRouter``) set verl's current step as each engine's
        weight version; a router of another kind, or none, leaves them."""
        router = getattr(self.server_manager, "_load_balancer", None)
        stamp = getattr(router, "stamp_versions", None) if router is not None else None
        if stamp is not None:
            await stamp.remote()


def register_polar_loop(name: str = "polar") -> type[PolarAgentLoop]:
    """Register ``PolarAgentLoop`` in verl's agent-loop registry under ``name`` (the
    same as the agent-loop config entry examples/verl_grpo/agent_loops.yaml gives)."""
    return register(name)(PolarAgentLoop)


# -- engines ------------------------------------------------------------------------------


class ProxySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The router config's ``polar:`` entry: the proxy Polar serves from verl's servers."""

    python: str | None = None  # Polar's venv's python; None: $POLAR_PYTHON
    env_file: str | None = None  # the stack's polar.env; None: $POLAR_ENV_FILE
    host: str = "127.0.0.1"
    port: int = 8200  # where the stack's nodes reach the proxy (their proxy_url)
    kind: str = "vllm"  # vllm | sglang: verl's rollout.name
    model_dir: str  # the served model's files: its tokenizer for token mode
    model: str = "default"  # the name the engines serve it under
    mode: str = "token"
    start_timeout_seconds: float = 120.0


def proxy_config(settings: ProxySettings, servers: list[str], env: dict[str, str]) -> dict:
    """``polar serve proxy``'s POLAR_CONFIG: verl's servers as its backends, the stack's
    NATS, Redis and admin token (``services.client.connection``)."""
    stack = polar_connection.from_environment(env)
    config = {
        "host": settings.host,
        "port": settings.port,
        "mode": settings.mode,
        "model_dir": settings.model_dir,
        "backend": {
            "kind": settings.kind,
            "urls": [a if "://" in a else f"http://{a}" for a in servers],
            "model": settings.model,
        },
    }
    for key in ("nats_url", "redis_url", "admin_token"):
        if (value := getattr(stack, key)) is not None:
            config[key] = value
    return config


def _die_with_parent() -> None:
    """In the proxy's process, before it starts: a SIGTERM when the router's process
    dies (Ray ends actors with SIGKILL, which leaves no time to stop it)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _global_steps(server: Any) -> int | None:
    """Run inside verl's server actor: the step of its last weight sync."""
    return getattr(server, "global_steps", None)


class PolarRouter(GlobalRequestLoadBalancer):
    """verl's router (module docstring, "Engines")."""

    def __init__(self, servers: dict[str, Any], config: dict[str, Any] | None = None) -> None:
        super().__init__(servers)
        raw = dict((config or {}).get("polar") or {})
        self.settings = msgspec.convert(raw, ProxySettings)
        self.proxy: subprocess.Popen | None = None
        self.stamped: dict[str, int] = {}  # server -> the version last set on it
        self.serve()

    def add_servers(self, servers: dict[str, Any]) -> None:
        super().add_servers(servers)
        self.serve()

    def remove_servers(self, server_ids: list[str]) -> None:
        super().remove_servers(server_ids)
        self.serve()

    def serve(self) -> None:
        """(Re)start Polar's proxy on verl's current servers."""
        self.stop()
        servers = self.get_all_servers()
        if not servers:
            return
        env = dict(os.environ)
        if self.settings.env_file:
            env[polar_connection.FILE_VAR] = self.settings.env_file
        python = self.settings.python or env.get("POLAR_PYTHON")
        if not python:
            raise ValueError("PolarRouter: set polar.python (or $POLAR_PYTHON): Polar's venv")
        env["POLAR_CONFIG"] = msgspec.json.encode(
            proxy_config(self.settings, servers, env)
        ).decode()
        env.pop("PYTHONPATH", None)  # Polar's venv, not verl's
        argv = [python, "-m", "services.cli.main", "serve", "proxy"]
        self.proxy = subprocess.Popen(
            argv, env=env, cwd=REPO, start_new_session=True, preexec_fn=_die_with_parent
        )
        self.stamped.clear()
        self._wait_healthy()
        log.info("Polar's proxy serves from verl's servers %s", servers)

    def _wait_healthy(self) -> None:
        import httpx

        url = f"http://{self.settings.host}:{self.settings.port}/healthz"
        deadline = time.monotonic() + self.settings.start_timeout_seconds
        while time.monotonic() < deadline:
            if self.proxy is not None and self.proxy.poll() is not None:
                raise RuntimeError(f"Polar's proxy exited with {self.proxy.returncode}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"Polar's proxy did not answer {url} in time")

    def stop(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            os.killpg(self.proxy.pid, signal.SIGTERM)
            try:
                self.proxy.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proxy.pid, signal.SIGKILL)
        self.proxy = None

    def stamp_versions(self) -> dict[str, int]:
        """Set verl's step as the weight version of every server whose step changed since
        (``POST /update_weight_version``: SGLang's, and vLLM's with VLLM_SERVER_DEV_MODE=1),
        so the proxy stamps verl's version on what it captures."""
        import httpx
        import ray

        for server, handle in self._servers.items():
            step = ray.get(handle.__ray_call__.remote(_global_steps))
            if step is None or self.stamped.get(server) == step:
                continue
            url = server if "://" in server else f"http://{server}"
            body = {"new_version": str(step)}
            httpx.post(f"{url}/update_weight_version", json=body, timeout=30).raise_for_status()
            self.stamped[server] = step
        return dict(self.stamped)
