"""Where a client finds the stack: one set of ``POLAR_*`` variables, the same in an
environment file and in the environment.

``polar up`` writes them to ``<state_dir>/polar.env`` (0600) once the stack is healthy,
with the credentials its clients sign in with::

    POLAR_NATS_URL=nats://cli:<password>@127.0.0.1:4222
    POLAR_REDIS_URL=redis://:<password>@127.0.0.1:6379/0
    POLAR_ADMIN_TOKEN=pa_...          # the scheduler's writes, the proxy's /admin/*
    POLAR_READ_TOKEN=pr_...           # the scheduler's and the dashboard's reads
    POLAR_PROXY_URL=http://127.0.0.1:8200
    POLAR_SCHEDULER_URL=http://127.0.0.1:8100
    POLAR_DASHBOARD_URL=http://127.0.0.1:8160
    POLAR_STATE_DIR=/path/to/.state

A client takes them from the file ``$POLAR_ENV_FILE`` names, then from the environment
(a variable set there wins: ``set -a; . .state/polar.env; set +a`` sets them all).
``polar train``, ``polar submit``, ``polar status`` and ``polar export`` read the same
stack from ``-t topology.yaml`` (its state dir's record and credentials) first; this
module is the path for everything without a topology: a user's script, the TRL and slime
adapters, a container given the file. This module owns the file's format (written by
``infra/devstack.py``, read here).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

ENV_FILE = "polar.env"  # under the stack's state dir
FILE_VAR = "POLAR_ENV_FILE"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
VARIABLES = {  # Connection field -> its variable
    "nats_url": "POLAR_NATS_URL",
    "redis_url": "POLAR_REDIS_URL",
    "admin_token": "POLAR_ADMIN_TOKEN",
    "read_token": "POLAR_READ_TOKEN",
    "proxy_url": "POLAR_PROXY_URL",
    "scheduler_url": "POLAR_SCHEDULER_URL",
    "dashboard_url": "POLAR_DASHBOARD_URL",
    "state_dir": "POLAR_STATE_DIR",
}


class EnvFileError(RuntimeError):
    """The environment file named cannot be read."""


@dataclass(frozen=True)
class Connection:
    """A stack as its clients reach it; None: not known (the client's default applies)."""

    nats_url: str | None = None
    redis_url: str | None = None
    admin_token: str | None = None
    read_token: str | None = None
    proxy_url: str | None = None
    scheduler_url: str | None = None
    dashboard_url: str | None = None
    state_dir: str | None = None

    def variables(self) -> dict[str, str]:
        """The ``POLAR_*`` variables this connection sets (the known ones)."""
        return {
            VARIABLES[f.name]: value
            for f in fields(self)
            if (value := getattr(self, f.name)) is not None
        }

    def env_file(self, header: str = "") -> str:
        """The environment file's text: ``KEY=value`` lines, shell-quoted where needed
        (``. polar.env`` in sh, ``--env-file`` in docker, ``EnvironmentFile`` in systemd
        read it as well as ``read_env_file``)."""
        lines = [f"# {line}" for line in header.splitlines()]
        lines += [f"{k}={shlex.quote(v)}" for k, v in self.variables().items()]
        return "\n".join(lines) + "\n"

    @classmethod
    def of(cls, values: Mapping[str, str]) -> Connection:
        """The connection the ``POLAR_*`` variables in ``values`` name (empty ones unset)."""
        return cls(**{f: values.get(var) or None for f, var in VARIABLES.items()})

    def over(self, base: Connection) -> Connection:
        """This connection, with what it leaves unknown taken from ``base``."""
        return Connection(
            **{f.name: getattr(self, f.name) or getattr(base, f.name) for f in fields(self)}
        )

    @property
    def known(self) -> bool:
        return self.nats_url is not None


def read_env_file(path: str | Path) -> dict[str, str]:
    """``KEY=value`` lines (``#`` comments, blank lines and a leading ``export`` allowed;
    values shell-quoted or bare)."""
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise EnvFileError(f"cannot read the environment file {path}: {exc.strerror}") from None
    values = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.removeprefix("export ").partition("=")
        try:
            words = shlex.split(value)
        except ValueError:
            words = [value]
        values[key.strip()] = words[0] if words else ""
    return values


def from_environment(env: Mapping[str, str] | None = None) -> Connection:
    """The file ``$POLAR_ENV_FILE`` names, with the ``POLAR_*`` variables set in ``env``
    over it (each may be unknown: ``Connection.known`` says whether NATS is)."""
    env = os.environ if env is None else env
    given = Connection.of(env)
    path = env.get(FILE_VAR)
    return given.over(Connection.of(read_env_file(path))) if path else given


def nats_url(url: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """``url``, else the environment's (``from_environment``), else the default
    ``nats://127.0.0.1:4222``."""
    return url or from_environment(env).nats_url or DEFAULT_NATS_URL
