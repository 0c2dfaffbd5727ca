"""Fresh credentials for a deployment (compose, Slurm), as an env file:

    python -m infra.deploy.tokens build/compose/tokens.env   # written 0600; kept if there
    set -a; . build/compose/tokens.env; set +a

``POLAR_ADMIN_TOKEN``, ``POLAR_READ_TOKEN`` and ``POLAR_ENGINE_API_KEY``, made as
``polar up`` makes its own (``infra/credentials.py``). An existing file is left as it is:
a stack restarted with new tokens would refuse the trainer and the dashboards holding
the old ones. Without a path, the assignments go to stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

from infra.credentials import token, write_private

PREFIXES = {"POLAR_ADMIN_TOKEN": "pa_", "POLAR_READ_TOKEN": "pr_", "POLAR_ENGINE_API_KEY": "pe_"}


def env_file() -> str:
    """The three variables with fresh values (URL-safe: no quoting needed)."""
    return "".join(f"{var}={token(prefix)}\n" for var, prefix in PREFIXES.items())


def ensure(path: Path) -> bool:
    """Write ``path`` (0600) unless it exists; True when written."""
    if path.exists():
        return False
    write_private(path, env_file().encode())
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.stdout.write(env_file())
        return 0
    path = Path(args[0])
    written = ensure(path)
    print(f"{'wrote' if written else 'kept'} {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
