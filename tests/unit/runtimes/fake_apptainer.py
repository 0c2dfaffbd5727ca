"""A stand-in `apptainer` CLI for the CLI-boundary tests (apptainer cannot be installed on
the machines this project is developed on; this is the one place a stand-in is used).

It appends its argv as a JSON line to $FAKE_APPTAINER_LOG and emulates just enough:
`instance start` remembers the --home/--bind mappings, `exec ... instance://NAME CMD`
runs CMD on the node with --pwd mapped through them and only the --env variables (as
--cleanenv would), `instance stop` forgets the instance (exit 255 if unknown, like the
real CLI). It proves the argvs Polar issues, not apptainer's behaviour.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _state(name: str) -> Path:
    return Path(os.environ["FAKE_APPTAINER_LOG"]).with_name(f"instance-{name}.json")


def _mounts(opts: list[str]) -> dict[str, str]:
    pairs = [opts[i + 1] for i, o in enumerate(opts) if o in ("--bind", "--home")]
    return {spec.split(":")[1]: spec.split(":")[0] for spec in pairs}


def _to_node(path: str, mounts: dict[str, str]) -> str:
    for inside in sorted(mounts, key=len, reverse=True):
        if path == inside or path.startswith(inside + "/"):
            return mounts[inside] + path[len(inside) :]
    return path


def _exec(args: list[str]) -> int:
    at = next(i for i, a in enumerate(args) if a.startswith("instance://"))
    opts, command = args[:at], args[at + 1 :]
    state = _state(args[at].removeprefix("instance://"))
    if not state.exists():
        print("FATAL: no instance found", file=sys.stderr)
        return 255
    mounts = json.loads(state.read_text())
    env = {"PATH": os.environ["PATH"]}
    env.update(opts[i + 1].split("=", 1) for i, o in enumerate(opts) if o == "--env")
    cwd = _to_node(opts[opts.index("--pwd") + 1], mounts)
    return subprocess.call(command, env=env, cwd=cwd)


def main(args: list[str]) -> int:
    with open(os.environ["FAKE_APPTAINER_LOG"], "a") as log:
        log.write(json.dumps(args) + "\n")
    if args[0] == "exec":
        return _exec(args[1:])
    if args[:2] == ["instance", "start"]:
        _state(args[-1]).write_text(json.dumps(_mounts(args[2:-2])))
        return 0
    if args[:2] == ["instance", "stop"]:
        state = _state(args[-1])
        if not state.exists():
            return 255
        state.unlink()
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
