"""A context for the official ``nats`` CLI (github.com/nats-io/natscli): ``polar up``
writes one for its stack, so that ``nats --context polar pub polar.tasks.submit …`` signs
in as the operator's ``cli`` user.

The CLI keeps its contexts as JSON files, one per name, in
``$XDG_CONFIG_HOME/nats/context/<name>.json`` (default ``~/.config/nats/context``; the
CLI's package ``jsm.go/natscontext``): ``url`` (comma-separated servers), ``user`` and
``password``, or ``token`` / ``creds`` / ``nkey``, TLS files (``cert``, ``key``, ``ca``),
and the JetStream domain or prefixes. Only ``<name>.json`` is written here: the user's
other contexts, and which one is selected (``context.txt``), are left alone. A file of
that name that Polar did not write (its ``description`` does not start with ``MARK``)
is not overwritten.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from infra.credentials import write_private
from services.common.endpoints import nats_servers

DEFAULT_NAME = "polar"
MARK = "Polar stack"  # the description of every context Polar writes starts so
FIELDS = (  # the CLI's settings, as it writes them itself
    "description",
    "url",
    "token",
    "user",
    "password",
    "creds",
    "nkey",
    "cert",
    "key",
    "ca",
    "nsc",
    "jetstream_domain",
    "jetstream_api_prefix",
    "jetstream_event_prefix",
    "inbox_prefix",
)


class ContextTaken(RuntimeError):
    """A context of that name exists and is not one Polar wrote."""


def context_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "nats" / "context"


def context_path(name: str, env: Mapping[str, str] | None = None) -> Path:
    if not name or ".." in name or "/" in name or os.sep in name:
        raise ValueError(f"not a context name: {name!r}")
    return context_dir(env) / f"{name}.json"


def context_settings(nats_url: str, description: str) -> dict[str, str]:
    """The context for ``nats_url`` (its servers without credentials in ``url``, the
    first server's user and password in ``user`` / ``password``)."""
    servers = [urlsplit(s) for s in nats_servers(nats_url)]
    first = servers[0]
    bare = [urlunsplit(s._replace(netloc=s.netloc.rpartition("@")[2])) for s in servers]
    settings = dict.fromkeys(FIELDS, "")
    settings.update(
        description=description,
        url=",".join(bare),
        user=unquote(first.username or ""),
        password=unquote(first.password or ""),
    )
    return settings


def ours(path: Path) -> bool:
    """Absent, or written by Polar (so it may be rewritten)."""
    try:
        data = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and str(data.get("description", "")).startswith(MARK)


def write_context(
    name: str, nats_url: str, state_dir: Path, env: Mapping[str, str] | None = None
) -> Path:
    """Write (or rewrite) context ``name`` for the stack in ``state_dir``; 0600, in a
    0700 directory, as the CLI makes them. Raises ContextTaken for a user's own."""
    path = context_path(name, env)
    if not ours(path):
        raise ContextTaken(
            f"{path} is not a context polar wrote: left as it is (name another with "
            "`polar up --nats-context NAME`)"
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    settings = context_settings(nats_url, f"{MARK} in {state_dir} (written by `polar up`)")
    write_private(path, json.dumps(settings, indent=2).encode() + b"\n")
    return path
