"""The custom plugins a task names (``"module:Class"``), checked at submission.

A service accepts what its own registry's ``load_custom`` accepts: a class of the
registry's kind (``services/common/plugins.py``). Telling that needs the module imported,
and an import runs the module's import-time code. The scheduler has never imported a
plugin (``logic`` only asks whether its module can be found), and every task comes through
it: a module whose import aborts, hangs or changes the process would take it down for all.
So the registries' own ``load_custom`` runs in a child process (this module, with this
process's Python, ``sys.path`` and environment), once per plugin within ``CACHE_SECONDS``,
at most ``CHILDREN`` at once; a child that dies or overruns is a refusal that says so.
The registries are named here, not imported: the builder's belongs to a service of the
scheduler's own layer, and this process needs nothing of theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import sys
import time

import orjson

from services.scheduler.logic import PluginRef

REGISTRIES = {  # kind -> "module:function" making the registry the service loads it with
    "harness": "services.node.harnesses:default_registry",
    "builder": "services.builder.strategies:default_registry",
    "evaluator": "evaluators.registry:default_registry",
}
TIMEOUT_S = 20.0
CACHE_SECONDS = 60.0
CHILDREN = 2

Key = tuple[str, str]  # (kind, name)


class PluginCheck:
    def __init__(self, *, timeout: float = TIMEOUT_S, cache_seconds: float = CACHE_SECONDS):
        self.timeout, self.cache_seconds = timeout, cache_seconds
        self._known: dict[Key, tuple[str | None, float]] = {}  # verdict, until (monotonic)
        self._pending: dict[Key, asyncio.Future[dict[Key, str | None]]] = {}
        self._children = asyncio.Semaphore(CHILDREN)

    async def refusal(self, refs: list[PluginRef]) -> tuple[str, str] | None:
        """(field, reason) for the first custom plugin of ``refs`` no service would load."""
        custom = [r for r in refs if r.custom]
        if not custom:
            return None
        verdicts = await self.verdicts([(r.kind, r.name) for r in custom])
        for ref in custom:
            reason = verdicts.get((ref.kind, ref.name))
            if reason:
                return ref.field, reason
        return None

    async def verdicts(self, keys: list[Key]) -> dict[Key, str | None]:
        """Why each plugin would be refused (None: it would be loaded); one child for the
        ones neither known nor being checked already."""
        now = time.monotonic()
        out: dict[Key, str | None] = {}
        todo: list[Key] = []
        waits: dict[Key, asyncio.Future] = {}
        for key in dict.fromkeys(keys):
            known = self._known.get(key)
            if known is not None and known[1] > now:
                out[key] = known[0]
            elif key in self._pending:
                waits[key] = self._pending[key]
            else:
                todo.append(key)
        if todo:
            out.update(await self._check(todo))
        for key, fut in waits.items():
            out[key] = (await asyncio.shield(fut)).get(key, "not checked: try again")
        return out

    async def _check(self, keys: list[Key]) -> dict[Key, str | None]:
        fut: asyncio.Future[dict[Key, str | None]] = asyncio.get_running_loop().create_future()
        for key in keys:
            self._pending[key] = fut
        try:
            got = await self._run_child(keys)
            until = time.monotonic() + self.cache_seconds
            self._known.update({k: (v, until) for k, v in got.items() if k in keys})
            fut.set_result(got)
            return {
                k: got.get(k, "not checked: another plugin of the task ended the check")
                for k in keys
            }
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: only the waiters care
            raise
        finally:
            for key in keys:
                self._pending.pop(key, None)

    async def _run_child(self, keys: list[Key]) -> dict[Key, str | None]:
        """The verdicts the child wrote; when it died or overran, the plugin it was
        checking then gets that as its verdict (those after it get none)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        async with self._children:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )  # fmt: skip
            try:
                out, err = await asyncio.wait_for(
                    proc.communicate(orjson.dumps(keys)), self.timeout
                )
                ended = _how_it_ended(proc.returncode, err)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                out, _ = await proc.communicate()
                ended = f"checking it took over {self.timeout:g}s (does its import hang?)"
        got: dict[Key, str | None] = {}
        for line in out.splitlines():
            kind, name, problem = orjson.loads(line)
            got[(kind, name)] = problem
        unchecked = [k for k in keys if k not in got]
        if unchecked and ended:
            got[unchecked[0]] = ended
        return got


def _how_it_ended(returncode: int | None, stderr: bytes) -> str | None:
    if returncode == 0:
        return None
    if returncode is not None and returncode < 0:
        how = f"killed by {signal.Signals(-returncode).name}"
    else:
        how = f"exit code {returncode}"
    tail = stderr.decode("utf-8", "replace").strip()[-300:]
    return f"loading it ended the checking process ({how})" + (f": {tail}" if tail else "")


def problem(kind: str, name: str) -> str | None:
    """Why the service's registry of ``kind`` would not load ``name`` (None: it would)."""
    module, _, factory = REGISTRIES[kind].partition(":")
    registry = getattr(importlib.import_module(module), factory)()
    try:
        registry.load_custom(name)
    except Exception as exc:  # noqa: BLE001 - the registry's own error says how to fix it
        return str(exc) or repr(exc)
    return None


def main() -> None:
    """The child: (kind, name) pairs on stdin, one ``[kind, name, problem]`` line each on
    stdout as soon as it is known. Whatever a plugin's module prints goes to stderr."""
    keys = orjson.loads(sys.stdin.buffer.read())
    verdicts = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    for kind, name in keys:
        verdicts.write(orjson.dumps([kind, name, problem(kind, name)]) + b"\n")


if __name__ == "__main__":
    main()
